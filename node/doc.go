// Package node wires one kvactors node: NATS (embedded or external), the
// backend and host pool, the actor system (engine, request and transfer
// actors), the NATS subscriptions that feed them, and the admin HTTP server.
// Config holds every setting; Start brings a node up and Close takes it down
// in the one order written in Close.
package node
