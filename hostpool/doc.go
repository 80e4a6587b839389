// Package hostpool is the host pool's policy: which offload key lives where
// in the arena, which keys are pending (a copy is filling them) or ready
// (loadable), which are pinned by a load, and which ready keys are evicted
// when room is needed. It mirrors vLLM's CPUOffloadingManager (prepare_store,
// complete_store, lookup, prepare_load, touch, complete_load) with LRU
// eviction, and takes chunks of any size: the arena is cut into pages, a page
// is given to one slot size (class) when needed and back when empty, and a
// chunk is one or more slots (alloc.go). A store decision is all-or-nothing
// (plan.go): it evicts the shortest LRU prefix of evictable keys that makes
// room for every new chunk, or changes nothing. Keys are found through a
// pointer-free open-addressing index (index.go).
//
// The package is plain code: no memory (the arena is package store's), no
// locks, no clock. A Pool is owned by one caller at a time; Shared wraps it
// with a mutex for the actors that share one node's pool, and tells its
// Journal, under that mutex, of every change to what is loadable, so the
// node can announce them (kv_events) in the pool's own order.
package hostpool
