// Package holders is the pure core of cluster-wide lookup: an index of
// which live nodes hold which offload keys, per namespace (shared
// PROTOCOL.md, Clusters). It is fed by other nodes' kv_events (BlockStored,
// BlockRemoved, AllBlocksCleared), by their hellos and heartbeats (a node
// silent for the lease, or seen with a new boot, stops counting as a holder
// at once) and by key-set catch-up pages when a node joins or reconnects.
// It indexes at most a set number of keys per node (New's maxKeys), so no
// node can grow it without bound; the keys past the cap are left out and
// counted.
//
// It reads no clock (now is passed in) and does no I/O; package cluster
// feeds it from NATS. It imports only the standard library and messages/.
package holders
