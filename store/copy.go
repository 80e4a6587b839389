package store

// The copy path of a store or load job: Copy copies a job's chunks tile by
// tile between the device and the arena, taking (store) or checking (load)
// their checksums on the way, and completes the pool; Abort completes a
// job that never ran.

import (
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// tileBytes bounds the copy bytes of one device call: a job is copied a tile
// of whole chunks at a time, and each tile's checksums are taken (store) or
// checked (load) while its bytes are still in cache, instead of in a second
// pass over the whole job from memory (measured: the second pass cost 3x the
// copy time on the copy bench; docs/BENCHMARKS.md).
const tileBytes = 512 << 10

// Copy runs one job's copies and completes the pool: a store's chunks become
// ready with their checksums, computed tile by tile as they are copied in (or
// are freed if a copy failed); a load first reads back any chunk that is on
// disk only (disk to host, verified), then verifies each tile before copying
// it, then unpins. A load that finds a corrupt chunk stops there: that
// chunk's bytes never reach the device (earlier tiles have, which is
// harmless: the load fails as a whole), the chunk is dropped, and the error
// is ErrCorrupt in a *hostpool.KeyError naming it.
//
// live, when not nil, says whether the copy may go on (its engine may have
// given up on the node meanwhile and be reusing its blocks): it is asked
// between device calls (the caller asked before Copy), and for a store once
// more before the pool completes, since bytes read from blocks reused
// meanwhile must not become ready under the chunk's key. When it fails the
// job completes as a failed copy (a store's chunks freed, a load's
// unpinned) and Copy returns its error, wrapped.
func (e *Engine) Copy(dir backend.Direction, chunks []sched.JobChunk, live func() error) error {
	return named(e.copy(dir, chunks, live))
}

func (e *Engine) copy(dir backend.Direction, chunks []sched.JobChunk, live func() error) error {
	sc := copyScratchPool.Get().(*copyScratch)
	defer sc.release()
	sc.keys = appendKeys(sc.keys[:0], chunks)
	keys := sc.keys
	loc, ok := sc.reserved(dir, chunks)
	if !ok {
		var err error
		if loc, err = e.s.pool.Locate(keys); err != nil { // a bug: a job's keys are pending or pinned until it completes
			e.complete(dir, keys, nil)
			return fmt.Errorf("store: %w", err)
		}
	}
	lc := liveCheck{live: live}
	if dir == backend.HostToDevice {
		if bad, err := e.sizesMatch(keys, chunks, &loc); err != nil {
			e.complete(dir, keys, nil)
			return withPanic(err, afterEnd(func() { e.dropMisfit(keys[bad], &loc, bad) }))
		}
		read, err := e.fetch(keys, &loc)
		if err != nil {
			return err
		}
		lc.begun = read // a disk read takes time: the first device call is checked after one
	}
	ranges := sc.ranges[:0]
	defer func() { sc.ranges = ranges[:0] }()
	for lo := 0; lo < len(chunks); {
		if size := e.lay.Groups[chunks[lo].Group].ChunkBytes; size > tileBytes {
			if err := e.copyLarge(dir, keys, chunks, &loc, lo, size, &lc); err != nil {
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
			t := time.Now()
			err := e.verify(keys, &loc, lo, hi)
			e.s.sumLoad.Add(time.Since(t).Seconds())
			if err != nil {
				return err
			}
		}
		ranges = ranges[:0]
		for i := lo; i < hi; i++ {
			ranges = appendRanges(e.lay, &chunks[i], loc.Chunk(i), ranges)
		}
		if err := e.copyTile(dir, keys, &lc, ranges); err != nil {
			return err
		}
		if dir == backend.DeviceToHost {
			t := time.Now()
			for i := lo; i < hi; i++ {
				clearNulls(e.lay, &chunks[i], loc.Chunk(i), e.s.arena.Bytes(), 0, math.MaxInt64)
				loc.Sums[i] = e.s.checksum(loc.Chunk(i), 0, math.MaxInt64, 0)
			}
			e.s.sumStore.Add(time.Since(t).Seconds())
		}
		lo = hi
	}
	sums := loc.Sums
	if dir == backend.HostToDevice {
		sums = nil
		e.countHostHits(&loc)
	} else if err := e.goOn(dir, keys, &lc); err != nil {
		return err // the last tiles were read after the last ask
	}
	e.completeAt(dir, keys, loc.Slots, sums)
	return nil
}

// countHostHits counts the chunks of a load whose copy is done that came
// out of host memory (not read back from disk): only here, so a load that
// failed its disk read, a checksum, its engine's live check or the device
// copy counts no hit (docs/OBSERVABILITY.md, kvactors_pool_hits_total).
func (e *Engine) countHostHits(loc *located) {
	n := 0
	for _, st := range loc.States {
		if st != hostpool.Pending {
			n++
		}
	}
	if n > 0 {
		e.s.metrics.PoolHits.Add(float64(n))
	}
}

// copyTile copies one tile's ranges once the job may go on (goOn); a
// failed device copy completes the job as failed (a store's chunks freed, a
// load's unpinned).
func (e *Engine) copyTile(dir backend.Direction, keys []messages.Key, lc *liveCheck, ranges []backend.Range) error {
	if err := e.goOn(dir, keys, lc); err != nil {
		return err
	}
	if err := e.dev.Copy(dir, e.s.arena, ranges); err != nil {
		e.complete(dir, keys, nil)
		return err
	}
	return nil
}

// liveCheck is one Copy's live check and whether the copy is under way
// (a device call or a disk read done): the first device call needs no
// asking, Copy's caller asked just before.
type liveCheck struct {
	live  func() error
	begun bool
}

// goOn is called before each device call of a copy (and before a store
// completes the pool): once the copy is under way, it asks the copy's live
// check, and when that fails, completes the job as a failed copy. Once per
// tile, not per chunk: it reads a clock.
func (e *Engine) goOn(dir backend.Direction, keys []messages.Key, lc *liveCheck) error {
	if !lc.begun {
		lc.begun = true
		return nil
	}
	if lc.live == nil {
		return nil
	}
	if err := lc.live(); err != nil {
		e.complete(dir, keys, nil)
		return fmt.Errorf("store: copy stopped: %w", err)
	}
	return nil
}

// copyScratch is one Copy's working memory, reused across jobs: Copy keeps
// none of it after it returns (the pool copies what it keeps), and a store
// job allocating five slices per copy was a tenth of the node's garbage on
// the store-heavy bench.
type copyScratch struct {
	keys   []messages.Key
	loc    located
	ranges []backend.Range
}

var copyScratchPool = sync.Pool{New: func() any { return new(copyScratch) }}

// scratchKeep bounds what a scratch keeps: a rare huge job's slices are
// left to the collector rather than held by the pool.
const scratchKeep = 4096

func (sc *copyScratch) release() {
	clear(sc.keys) // the keys' strings are the job's, not ours to keep alive
	if cap(sc.keys) > scratchKeep || cap(sc.loc.Ext) > scratchKeep || cap(sc.ranges) > scratchKeep {
		return
	}
	copyScratchPool.Put(sc)
}

// reserved is a store job's room as its decision reserved it (JobChunk.Room),
// with no trip through the pool's lock, in the scratch's slices; false when
// a chunk has none.
func (sc *copyScratch) reserved(dir backend.Direction, chunks []sched.JobChunk) (hostpool.Located, bool) {
	if dir != backend.DeviceToHost {
		return hostpool.Located{}, false
	}
	for i := range chunks {
		if chunks[i].Room == nil {
			return hostpool.Located{}, false
		}
	}
	loc := &sc.loc
	n := len(chunks) // each slice reused when big enough; every element is written below
	loc.Ext, loc.Ends = loc.Ext[:0], slices.Grow(loc.Ends[:0], n)[:n]
	loc.Sums, loc.Slots, loc.States = slices.Grow(loc.Sums[:0], n)[:n], slices.Grow(loc.Slots[:0], n)[:n], nil
	for i := range chunks {
		loc.Ext = append(loc.Ext, chunks[i].Room...)
		loc.Ends[i] = len(loc.Ext)
		loc.Slots[i] = chunks[i].Slot
	}
	return *loc, true
}

// fetch reads the load's chunks that are pending (given room by PrepareLoad
// to come back from disk) into host memory, in one disk read for the whole
// load (records lying back to back on disk are read together), then makes
// them ready and pinned, and reports whether it read any. A chunk that
// cannot be read back fails the load naming it.
func (e *Engine) fetch(keys []messages.Key, loc *located) (bool, error) {
	var at []int // the pending keys' indexes in keys
	var dks []messages.Key
	var dst [][][]byte
	b := e.s.arena.Bytes()
	for i, k := range keys {
		if loc.States[i] != hostpool.Pending {
			continue // a host hit: counted once the load's copy is done (copy)
		}
		var ext [][]byte
		for _, x := range loc.Chunk(i) {
			ext = append(ext, b[x.Off:x.Off+x.Len])
		}
		dk, _ := e.s.toDisk(k) // it was fetchable, so it maps
		at, dks, dst = append(at, i), append(dks, dk), append(dst, ext)
	}
	if len(at) == 0 {
		return false, nil
	}
	sums := make([]uint32, len(at))
	if j, err := e.s.disk.ReadMany(e.id, dks, dst, sums); err != nil {
		e.complete(backend.HostToDevice, keys, nil) // frees every key still pending, unpins the rest
		if errors.Is(err, disk.ErrCorrupt) {
			e.s.metrics.Corrupt.Inc()
		}
		return true, &hostpool.KeyError{Key: keys[at[j]], Err: err}
	}
	fetched := make([]messages.Key, len(at))
	for j, i := range at {
		loc.Sums[i] = sums[j]
		fetched[j] = keys[i]
	}
	e.s.pool.By(e.id).CompleteStorePinned(fetched, sums)
	return true, nil
}

// sizesMatch checks that each chunk a load copies out is as large as its
// group's chunks: a chunk read back from disk was given room of its
// record's size, and a record of another size under the key (a geometry
// the disk key's fingerprint failed to tell apart, a record left by
// another build) must not reach the device as if it were the chunk.
// It returns the first misfit's index with the error.
func (e *Engine) sizesMatch(keys []messages.Key, chunks []sched.JobChunk, loc *located) (int, error) {
	for i := range chunks {
		var size int64
		for _, x := range loc.Chunk(i) {
			size += x.Len
		}
		if want := e.lay.Groups[chunks[i].Group].ChunkBytes; size != want {
			e.s.metrics.Corrupt.Inc()
			return i, &hostpool.KeyError{Key: keys[i],
				Err: fmt.Errorf("%w: %d bytes held, the group's chunks are %d", ErrCorrupt, size, want)}
		}
	}
	return 0, nil
}

// afterEnd runs a step that follows the load's end in the pool (dropping
// a chunk that failed its check) and returns a panic in it (a bug below:
// the disk tier, the journal) as an error instead of letting it out of
// Copy. The transfer side aborts the pool side of a copy that panicked,
// and these keys are no longer this load's to end: one freed here may be
// another job's pending chunk by then, and its pins other loads'.
func afterEnd(step func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("store: dropping a chunk after the load ended panicked: %v", r)
		}
	}()
	step()
	return nil
}

// withPanic is err, joined with panicked if a step after the load's end
// panicked (afterEnd).
func withPanic(err, panicked error) error {
	if panicked == nil {
		return err
	}
	return errors.Join(err, panicked)
}

// dropMisfit drops chunk i of a load that sizesMatch refused, the load
// ended: its record on disk (a read-back) or its pool entry, as a chunk
// found corrupt is dropped, so lookups stop counting it and later loads
// stop failing on it.
func (e *Engine) dropMisfit(key messages.Key, loc *located, i int) {
	if loc.States[i] == hostpool.Pending {
		if dk, ok := e.s.toDisk(key); ok && e.s.disk != nil {
			e.s.disk.Drop(e.id, dk)
		}
		return
	}
	e.s.pool.By(e.id).Drop(key, loc.Sums[i])
}

// copyLarge copies chunk i, larger than a tile, a tile-sized window at a
// time; a store checksums each window after its copy, a load verifies the
// whole chunk before its first window moves.
func (e *Engine) copyLarge(dir backend.Direction, keys []messages.Key, chunks []sched.JobChunk, loc *located,
	i int, size int64, lc *liveCheck) error {
	cext := loc.Chunk(i)
	if dir == backend.HostToDevice {
		t := time.Now()
		err := e.verify(keys, loc, i, i+1)
		e.s.sumLoad.Add(time.Since(t).Seconds())
		if err != nil {
			return err
		}
	}
	var sum uint32
	var ranges []backend.Range
	for lo := int64(0); lo < size; lo += tileBytes {
		hi := min(lo+tileBytes, size)
		ranges = appendWindow(e.lay, &chunks[i], cext, lo, hi, ranges[:0])
		if err := e.copyTile(dir, keys, lc, ranges); err != nil {
			return err
		}
		if dir == backend.DeviceToHost {
			t := time.Now()
			clearNulls(e.lay, &chunks[i], cext, e.s.arena.Bytes(), lo, hi)
			sum = e.s.checksum(cext, lo, hi, sum)
			e.s.sumStore.Add(time.Since(t).Seconds())
		}
	}
	if dir == backend.DeviceToHost {
		loc.Sums[i] = sum
	}
	return nil
}

// located is hostpool.Located with its per-chunk view.
type located = hostpool.Located

// Abort completes a job that never ran (cancelled while queued): a store's
// pending chunks are freed, a load's unpinned (and any room it held for
// chunks to read back from disk freed).
func (e *Engine) Abort(dir backend.Direction, chunks []sched.JobChunk) {
	e.complete(dir, keysOf(chunks), nil)
}

func (e *Engine) complete(dir backend.Direction, keys []messages.Key, sums []uint32) {
	e.completeAt(dir, keys, nil, sums)
}

// completeAt is complete with a store's pool entries when its decision
// reported them (Located.Slots: no lookup per key).
func (e *Engine) completeAt(dir backend.Direction, keys []messages.Key, slots []int32, sums []uint32) {
	if dir == backend.HostToDevice {
		e.s.pool.By(e.id).EndLoad(keys) // a load's keys still pending were never read back
		return
	}
	e.s.pool.By(e.id).CompleteStoreAt(keys, slots, sums)
}

// verify checks chunks [lo, hi) of a load against their checksums. On a
// mismatch the load is unpinned and the chunk dropped.
func (e *Engine) verify(keys []messages.Key, loc *located, lo, hi int) error {
	for i := lo; i < hi; i++ {
		if loc.States[i] == hostpool.Pending {
			continue // read back from disk by fetch, which checked these very arena bytes
		}
		if got := e.s.checksum(loc.Chunk(i), 0, math.MaxInt64, 0); got != loc.Sums[i] {
			e.s.pool.CompleteLoad(keys)
			dropped := afterEnd(func() { e.s.pool.By(e.id).Drop(keys[i], loc.Sums[i]) })
			e.s.metrics.Corrupt.Inc()
			return withPanic(&hostpool.KeyError{Key: keys[i],
				Err: fmt.Errorf("%w: crc32c %08x, stored %08x", ErrCorrupt, got, loc.Sums[i])}, dropped)
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
	return appendKeys(make([]messages.Key, 0, len(chunks)), chunks)
}

func appendKeys(dst []messages.Key, chunks []sched.JobChunk) []messages.Key {
	for i := range chunks {
		dst = append(dst, chunks[i].Key)
	}
	return dst
}
