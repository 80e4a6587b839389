// Package embedded runs a NATS cluster inside the process: n nats-servers
// on loopback, routed to each other, each with JetStream and its own store
// directory. It is what `kvactors demo --cluster 3` will start and what
// internal/testkit.NATSCluster wraps for tests; production clusters are
// run by the operator, not by kvactors.
package embedded
