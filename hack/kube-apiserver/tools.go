//go:build tools

// Package kubeassets records the two programs that hack/kube-assets.sh builds
// so that go.mod and go.sum keep every module they need. Both are main
// packages, so this file is never compiled (the tools build tag is never set).
package kubeassets

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
