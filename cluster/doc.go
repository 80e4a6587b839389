// Package cluster owns kvactors' cluster building blocks on NATS itself
// (shared PROTOCOL.md, Clusters; docs/CLUSTER.md): engine ownership in a
// JetStream KV bucket (Owners: read, decide with ownership.Decide, claim by
// compare-and-set, keep alive on the last revision, which is the fencing
// token), the chunk fetch wire between nodes (ServeFetch, Fetcher: pieces
// under max_payload, CRC-32C of the whole chunk verified by the client) and
// the key-set catch-up wire (ServeKeys, CatchUp) that fills a holders.Index
// when a node joins or reconnects.
//
// The decisions are pure and live in the subpackages ownership and
// holders; this package does the NATS I/O around them. node/cluster.go
// wires it into the node (docs/CLUSTER.md, "In the node").
package cluster
