// Package testkit holds kvactors' test helpers, in the manner of
// nats-server's RunServer/checkFor: a real embedded NATS server per test
// (NATS, NATSServer, Connect, Subscribe), polling with a deadline instead of
// sleeping (Eventually), channel reads that always time out and say what
// they waited for (Recv, NoRecv, Closed), and a loop beside the test, as a
// heartbeat or keep-alive loop, that ends with it (Every).
//
// Every helper takes a testing.TB, calls t.Helper, fails the test itself and
// registers its own clean-up with t.Cleanup, so a test needs no defers.
package testkit
