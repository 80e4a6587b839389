// Command kvactors is the KV-cache offload service. It owns the command
// line: serve runs a node (package node; its flags come from
// node.Config.BindFlags), demo runs a node with simulated engines and
// checks every byte (--cluster N: N nodes on an N-server NATS cluster),
// bench measures a node and bench-compare two builds of it, nodes lists a
// cluster's nodes, flags prints the serve flag table of docs/CONFIG.md,
// nats-config writes a NATS configuration that isolates engines
// (docs/SECURITY.md), and version prints the build. Every command shares
// one table of exit codes (cli.go, docs/OPERATIONS.md).
package main
