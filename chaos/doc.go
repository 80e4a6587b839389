// Package chaos holds the fault-injection tests of protocol v2 (issue 10):
// real `kvactors serve` processes killed with SIGKILL, a NATS server
// stopped and restarted, a flood past the node's inbound bound, batches
// dropped in the engine SDK's transport, the node's released, stored and
// resync messages dropped on their way to it, a shutdown that times out. Each
// test says what it injects and what it proves; engines are driven by the
// Go engine SDK (package client) or the simulator (package sim).
//
// The tests build with the tag `chaos` so the default `go test ./...`
// stays fast. A short version of each runs with
//
//	go test -race -tags chaos ./chaos
//
// and the long versions with `-args -chaos.long`.
package chaos
