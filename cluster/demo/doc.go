// Package demo is `kvactors demo --cluster N`: an N-server NATS cluster
// (cluster/embedded) and N clustered nodes on loopback, engines on each
// (the client SDK), every engine storing prefixes in its own node's pool,
// then looking up and loading every prefix stored on the other nodes. It
// prints the cross-node hits, remote_chunks and load times, compares every
// remotely loaded byte with what its source engine stored, and ends with
// the `kvactors nodes` table.
package demo
