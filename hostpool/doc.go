// Package hostpool is the host pool's policy: which offload key lives in which
// fixed-size slot, which keys are pending (a copy is filling them) or ready
// (loadable), which are pinned by a load, and which ready key is evicted when
// room is needed. It mirrors vLLM's CPUOffloadingManager (prepare_store,
// complete_store, lookup, prepare_load, touch, complete_load) with LRU
// eviction.
//
// The package is plain code: no memory (the arena lives behind
// backend.Arena), no locks, no clock. A Pool is owned by one caller at a time;
// Shared wraps it with a mutex for the actors that share one node's pool.
package hostpool
