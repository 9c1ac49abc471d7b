// SPDX-License-Identifier: Apache-2.0

package proxy_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// TestConfigFromEnv: ztunnel's variables and defaults; what cannot work
// is refused naming the variable.
func TestConfigFromEnv(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root-cert.pem")
	must(t, os.WriteFile(root, []byte("-----BEGIN CERTIFICATE-----\n"), 0o644))
	base := map[string]string{
		proxy.EnvPodName: "ztunnel-a", proxy.EnvPodNamespace: "kube-system", proxy.EnvNodeName: "node-a",
	}
	from := func(extra map[string]string) (proxy.Config, error) {
		env := map[string]string{}
		for k, v := range base {
			env[k] = v
		}
		for k, v := range extra {
			env[k] = v
		}
		var environ []string
		for k, v := range env {
			environ = append(environ, k+"="+v)
		}
		return proxy.ConfigFromEnv(func(k string) string { return env[k] }, environ)
	}

	c, err := from(nil)
	must(t, err)
	if c.XDSAddress != "localhost:15012" || c.CAAddress != c.XDSAddress || c.TokenPath != proxy.DefaultTokenPath ||
		c.TrustDomain != "cluster.local" || c.ClusterID != "Kubernetes" || !c.Capture || c.IdleTimeout != time.Hour ||
		c.XDSRoot.Path != proxy.DefaultRootCA {
		t.Errorf("defaults: %+v", c)
	}

	c, err = from(map[string]string{
		proxy.EnvXDSAddress: "https://192.168.100.1:15012", proxy.EnvCAAddress: "ca.example:15012",
		proxy.EnvXDSRootCA: root, proxy.EnvCARootCA: "SYSTEM", proxy.EnvAuthToken: "/t",
		"ISTIO_META_CLUSTER_ID": "c1", proxy.EnvClusterID: "ignored", "ISTIO_META_FOO": "bar",
		proxy.EnvCapture: "false", proxy.EnvIdleTimeout: "0",
	})
	must(t, err)
	if c.XDSAddress != "192.168.100.1:15012" || c.CAAddress != "ca.example:15012" || c.XDSRoot.Path != root ||
		!c.CARoot.System || c.TokenPath != "/t" || c.ClusterID != "c1" || c.Metadata["FOO"] != "bar" || c.Capture || c.IdleTimeout != 0 {
		t.Errorf("set: %+v", c)
	}
	c, err = from(map[string]string{proxy.EnvXDSRootCA: "-----BEGIN CERTIFICATE-----\nabc"})
	must(t, err)
	if len(c.XDSRoot.PEM) == 0 {
		t.Errorf("literal PEM not taken as such: %+v", c.XDSRoot)
	}

	for _, bad := range []map[string]string{
		{proxy.EnvPodName: ""},
		{proxy.EnvNodeName: ""},
		{proxy.EnvXDSAddress: "http://istiod:15010"}, // TLS is mandatory
		{proxy.EnvXDSAddress: "istiod"},
		{proxy.EnvTrustDomain: "Not A Domain"},
		{proxy.EnvInstanceIP: "10.0.0"},
		{proxy.EnvCapture: "maybe"},
		{proxy.EnvIdleTimeout: "-1s"},
	} {
		if _, err := from(bad); !errors.Is(err, proxy.ErrConfig) {
			t.Errorf("%v: %v, want ErrConfig", bad, err)
		}
	}
}
