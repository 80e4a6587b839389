// Package deploy holds no code: it owns the packaging files beside it (the
// Dockerfile, the systemd unit, the Kubernetes manifests and the Grafana
// dashboard, docs/OPERATIONS.md) and the test that keeps them in step with
// the binary: the ports and probe paths agree with node.DefaultConfig, every
// config key is a serve flag, and every metric the dashboard queries exists
// on a running node.
package deploy
