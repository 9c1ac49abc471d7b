#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Prints a Secret holding new CA material for mtlsbridge: a self-signed
# ECDSA P-256 root of the trust domain, valid 10 years, as the agent makes
# in folder mode (ca-cert.pem, ca-key.pem; the signer reads the same keys
# from --ca-dir or --ca-secret). Then a ConfigMap with the root alone
# (roots.pem): the node agents' --ca-upstream-roots, which no node needs the
# Secret for.
#
#   deploy/create-ca-secret.sh [TRUST_DOMAIN] | kubectl create -f -
#
# Use `kubectl create`, not `apply`: apply would also copy the private key
# into an annotation. The key exists only in a private temporary folder,
# removed on exit, and on stdout. NAMESPACE and NAME override kube-system
# and mtlsbridge-ca (keep them in step with the Secret volume of
# deploy/kubernetes/mtlsbridge-signer.yaml and the ConfigMap volume, NAME-roots,
# of deploy/l2/cilium-values.yaml or deploy/inpod/cilium-values.yaml).
set -euo pipefail

td="${1:-cluster.local}"
ns="${NAMESPACE:-kube-system}"
name="${NAME:-mtlsbridge-ca}"
if [[ ! "${td}" =~ ^[a-z0-9._-]+$ ]]; then
	echo "create-ca-secret: trust domain ${td@Q}: want lower-case letters, digits, '.', '-' and '_'" >&2
	exit 2
fi
command -v openssl >/dev/null || { echo "create-ca-secret: needs openssl" >&2; exit 1; }

umask 077
tmp="$(mktemp -d)"
trap 'rm -rf -- "${tmp}"' EXIT

# The same extensions the agent gives a root it generates: a CA that signs
# certificates (and CRLs), named by its SPIFFE trust domain. A config of its
# own, so that no distribution default adds to it.
cat >"${tmp}/root.cnf" <<CNF
[req]
distinguished_name = dn
x509_extensions = root
prompt = no
[dn]
O = ${td}
CN = mtlsbridge root CA $(date -u +%Y-%m-%dT%H:%M:%SZ)
[root]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
subjectAltName = URI:spiffe://${td}
CNF
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "${tmp}/ca-key.pem" 2>/dev/null
openssl req -x509 -new -config "${tmp}/root.cnf" -key "${tmp}/ca-key.pem" -sha256 -days 3650 \
	-out "${tmp}/ca-cert.pem" 2>/dev/null

cat <<YAML
apiVersion: v1
kind: Secret
metadata:
  name: ${name}
  namespace: ${ns}
  labels:
    app.kubernetes.io/name: mtlsbridge
type: Opaque
data:
  ca-cert.pem: $(base64 -w0 <"${tmp}/ca-cert.pem")
  ca-key.pem: $(base64 -w0 <"${tmp}/ca-key.pem")
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: ${name}-roots
  namespace: ${ns}
  labels:
    app.kubernetes.io/name: mtlsbridge
data:
  roots.pem: |
$(sed 's/^/    /' "${tmp}/ca-cert.pem")
YAML
