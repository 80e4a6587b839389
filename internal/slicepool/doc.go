// Package slicepool recycles slices through a sync.Pool, for the hot paths
// that reuse one slice per batch or per step (decoded events, a step's
// request messages). Get gives an empty slice (a fresh one of capacity New
// when the pool has none); Put keeps one whose capacity is at most Keep, so
// a rare huge slice is left to the collector. Put keeps the contents as
// they are: the caller clears what they point to first, so nothing is kept
// alive through the pool.
package slicepool
