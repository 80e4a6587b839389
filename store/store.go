package store

import (
	"errors"
	"fmt"
	"hash/crc32"
	"math"

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

// tileBytes bounds the copy bytes of one device call: a job is copied a tile
// of whole chunks at a time, and each tile's checksums are taken (store) or
// checked (load) while its bytes are still in cache, instead of in a second
// pass over the whole job from memory (measured: the second pass cost 3x the
// copy time on the copy bench; docs/BENCHMARKS.md).
const tileBytes = 512 << 10

// Copy runs one job's copies and completes the pool: a store's chunks become
// ready with their checksums, computed tile by tile as they are copied in (or
// are freed if a copy failed); a load's chunks are verified tile by tile
// before the tile is copied, then unpinned. A load that finds a corrupt chunk
// stops there: that chunk's bytes never reach the device (earlier tiles
// have, which is harmless: the load fails as a whole), the chunk is dropped,
// and the error is ErrCorrupt in a *hostpool.KeyError naming it.
func (e *Engine) Copy(dir backend.Direction, chunks []sched.JobChunk) error {
	keys := keysOf(chunks)
	ext, ends, sums, err := e.s.pool.Locate(keys, nil, make([]int, 0, len(keys)), make([]uint32, 0, len(keys)))
	if err != nil { // a bug: a job's keys are pending or pinned until it completes
		e.complete(dir, keys, nil)
		return fmt.Errorf("store: %w", err)
	}
	var ranges []backend.Range
	for lo := 0; lo < len(chunks); {
		if size := e.lay.Groups[chunks[lo].Group].ChunkBytes; size > tileBytes {
			if err := e.copyLarge(dir, keys, chunks, ext, ends, sums, lo, size); err != nil {
				return err
			}
			lo++
			continue
		}
		hi, n := lo, int64(0) // a tile of whole chunks
		for ; hi < len(chunks) && e.lay.Groups[chunks[hi].Group].ChunkBytes <= tileBytes &&
			(hi == lo || n+e.lay.Groups[chunks[hi].Group].ChunkBytes <= tileBytes); hi++ {
			n += e.lay.Groups[chunks[hi].Group].ChunkBytes
		}
		if dir == backend.HostToDevice {
			if err := e.verify(keys, ext, ends, sums, lo, hi); err != nil {
				return err
			}
		}
		ranges = ranges[:0]
		for i := lo; i < hi; i++ {
			ranges = appendRanges(e.lay, &chunks[i], ext[start(ends, i):ends[i]], ranges)
		}
		if err := e.dev.Copy(dir, e.s.arena, ranges); err != nil {
			e.complete(dir, keys, nil)
			return err
		}
		if dir == backend.DeviceToHost {
			for i := lo; i < hi; i++ {
				sums[i] = e.s.checksum(ext[start(ends, i):ends[i]], 0, math.MaxInt64, 0)
			}
		}
		lo = hi
	}
	if dir == backend.HostToDevice {
		sums = nil
	}
	e.complete(dir, keys, sums)
	return nil
}

// copyLarge copies chunk i, larger than a tile, a tile-sized window at a
// time; a store checksums each window after its copy, a load verifies the
// whole chunk before its first window moves.
func (e *Engine) copyLarge(dir backend.Direction, keys []messages.Key, chunks []sched.JobChunk,
	ext []hostpool.Extent, ends []int, sums []uint32, i int, size int64) error {
	cext := ext[start(ends, i):ends[i]]
	if dir == backend.HostToDevice {
		if err := e.verify(keys, ext, ends, sums, i, i+1); err != nil {
			return err
		}
	}
	var sum uint32
	var ranges []backend.Range
	for lo := int64(0); lo < size; lo += tileBytes {
		hi := min(lo+tileBytes, size)
		ranges = appendWindow(e.lay, &chunks[i], cext, lo, hi, ranges[:0])
		if err := e.dev.Copy(dir, e.s.arena, ranges); err != nil {
			e.complete(dir, keys, nil)
			return err
		}
		if dir == backend.DeviceToHost {
			sum = e.s.checksum(cext, lo, hi, sum)
		}
	}
	if dir == backend.DeviceToHost {
		sums[i] = sum
	}
	return nil
}

// start is where chunk i's extents begin.
func start(ends []int, i int) int {
	if i == 0 {
		return 0
	}
	return ends[i-1]
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

// verify checks chunks [lo, hi) of a load against their checksums. On a
// mismatch the load is unpinned and the chunk dropped.
func (e *Engine) verify(keys []messages.Key, ext []hostpool.Extent, ends []int, sums []uint32, lo, hi int) error {
	for i := lo; i < hi; i++ {
		if got := e.s.checksum(ext[start(ends, i):ends[i]], 0, math.MaxInt64, 0); got != sums[i] {
			e.s.pool.CompleteLoad(keys)
			e.s.pool.Drop(keys[i])
			e.s.metrics.Corrupt.Inc()
			return &hostpool.KeyError{Key: keys[i],
				Err: fmt.Errorf("%w: crc32c %08x, stored %08x", ErrCorrupt, got, sums[i])}
		}
	}
	return nil
}

// checksum continues sum over the chunk's logical bytes [lo, hi), which lie
// in ext in order.
func (s *Store) checksum(ext []hostpool.Extent, lo, hi int64, sum uint32) uint32 {
	b := s.arena.Bytes()
	var at int64 // logical offset of x
	for _, x := range ext {
		a, z := max(lo, at), min(hi, at+x.Len)
		if a < z {
			sum = crc32.Update(sum, castagnoli, b[x.Off+a-at:x.Off+z-at])
		}
		at += x.Len
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
