package store

import (
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// ErrCorrupt means a stored chunk's bytes no longer match the CRC-32C taken
// when they were copied in; it comes wrapped in a *hostpool.KeyError naming
// the key. The chunk was dropped and none of the load's bytes reached the
// device (PROTOCOL.md, "Integrity").
var ErrCorrupt = errors.New("store: chunk checksum mismatch")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Store owns a node's host pool and arena. Safe for concurrent use: the pool
// is behind one mutex (hostpool.Shared), and the arena bytes of a chunk are
// only written while its key is pending and only read while it is pinned.
type Store struct {
	pool    *hostpool.Shared
	arena   backend.Arena
	metrics *metrics.Metrics
}

// New returns the store over arena, its pool cut into pages of pageBytes
// (hostpool.DefaultPageBytes when <= 0).
func New(arena backend.Arena, pageBytes int64, m *metrics.Metrics) *Store {
	return &Store{pool: hostpool.NewShared(int64(len(arena.Bytes())), pageBytes), arena: arena, metrics: m}
}

// Stats is the pool's usage.
func (s *Store) Stats() hostpool.Stats { return s.pool.Stats() }

// Ready reports whether key is stored and loadable (a lookup hit).
func (s *Store) Ready(key messages.Key) bool {
	st, _ := s.pool.Lookup(key)
	return st == hostpool.Ready
}

// Fits reports whether a chunk of size bytes can be stored at all (it is not
// larger than the pool).
func (s *Store) Fits(size int64) bool { return size <= s.pool.Capacity() }

// Engine is the store as one engine's copies use it: its layout and device.
type Engine struct {
	s   *Store
	lay *sched.Layout
	dev backend.Device
}

// Engine binds the store to an engine's layout and device.
func (s *Store) Engine(lay *sched.Layout, dev backend.Device) *Engine {
	return &Engine{s: s, lay: lay, dev: dev}
}

// Layout is the engine's layout.
func (e *Engine) Layout() *sched.Layout { return e.lay }

// PrepareStore makes room for a decision's chunks (sched.Preparer).
func (e *Engine) PrepareStore(keys []messages.Key, sizes []int64) (hostpool.Prepared, error) {
	return e.s.pool.PrepareStore(keys, sizes)
}

// PrepareLoad pins the keys of a load (all ready) and touches them.
func (e *Engine) PrepareLoad(keys []messages.Key) error { return e.s.pool.PrepareLoad(keys) }

// Copy runs one job's copies and completes the pool: a store's chunks become
// ready with their checksums (or are freed if the copy failed); a load's
// chunks are verified first, then copied, then unpinned. A load that finds a
// corrupt chunk copies nothing, drops the chunk and returns ErrCorrupt in a
// *hostpool.KeyError naming it.
func (e *Engine) Copy(dir backend.Direction, chunks []sched.JobChunk) error {
	keys := keysOf(chunks)
	ext, ends, sums, err := e.s.pool.Locate(keys, nil, make([]int, 0, len(keys)), make([]uint32, 0, len(keys)))
	if err != nil { // a bug: a job's keys are pending or pinned until it completes
		e.complete(dir, keys, nil)
		return fmt.Errorf("store: %w", err)
	}
	if dir == backend.HostToDevice {
		if err := e.verify(keys, ext, ends, sums); err != nil {
			return err
		}
	}
	var ranges []backend.Range
	lo := 0
	for i := range chunks {
		ranges = appendRanges(e.lay, &chunks[i], ext[lo:ends[i]], ranges)
		lo = ends[i]
	}
	err = e.dev.Copy(dir, e.s.arena, ranges)
	if err != nil || dir == backend.HostToDevice {
		e.complete(dir, keys, nil)
		return err
	}
	lo = 0
	for i := range keys {
		sums[i] = e.s.checksum(ext[lo:ends[i]])
		lo = ends[i]
	}
	e.complete(dir, keys, sums)
	return nil
}

// Abort completes a job that never ran (cancelled while queued): a store's
// pending chunks are freed, a load's unpinned.
func (e *Engine) Abort(dir backend.Direction, chunks []sched.JobChunk) {
	e.complete(dir, keysOf(chunks), nil)
}

func (e *Engine) complete(dir backend.Direction, keys []messages.Key, sums []uint32) {
	if dir == backend.HostToDevice {
		e.s.pool.CompleteLoad(keys)
		return
	}
	e.s.pool.CompleteStore(keys, sums)
}

// verify checks every chunk of a load against its checksum before any byte
// moves. On a mismatch the load is unpinned and the chunk dropped.
func (e *Engine) verify(keys []messages.Key, ext []hostpool.Extent, ends []int, sums []uint32) error {
	lo := 0
	for i, k := range keys {
		if got := e.s.checksum(ext[lo:ends[i]]); got != sums[i] {
			e.s.pool.CompleteLoad(keys)
			e.s.pool.Drop(k)
			e.s.metrics.Corrupt.Inc()
			return &hostpool.KeyError{Key: k, Err: fmt.Errorf("%w: crc32c %08x, stored %08x", ErrCorrupt, got, sums[i])}
		}
		lo = ends[i]
	}
	return nil
}

func (s *Store) checksum(ext []hostpool.Extent) uint32 {
	b := s.arena.Bytes()
	var sum uint32
	for _, x := range ext {
		sum = crc32.Update(sum, castagnoli, b[x.Off:x.Off+x.Len])
	}
	return sum
}

func keysOf(chunks []sched.JobChunk) []messages.Key {
	keys := make([]messages.Key, len(chunks))
	for i := range chunks {
		keys[i] = chunks[i].Key
	}
	return keys
}
