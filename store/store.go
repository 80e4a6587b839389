package store

import (
	"errors"
	"hash/crc32"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// ErrCorrupt means a stored chunk's bytes no longer match the CRC-32C taken
// when they were copied in; it comes wrapped in a *hostpool.KeyError naming
// the key. The chunk was dropped and none of its bytes reached the device
// (PROTOCOL.md, "Integrity").
var ErrCorrupt = errors.New("store: chunk checksum mismatch")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Store owns a node's host pool and arena, and the disk tier below them when
// there is one. Safe for concurrent use: the pool is behind one mutex
// (hostpool.Shared), and the arena bytes of a chunk are only written while
// its key is pending and only read while it is pinned, or, by the disk
// tier's spill of an evicted chunk, after the eviction and checked against
// the chunk's checksum (a spill whose room was reused meanwhile is
// dropped).
type Store struct {
	pool    *hostpool.Shared
	arena   backend.Arena
	disk    *disk.Disk // nil: no disk tier
	metrics *metrics.Pool
	// checksum time by direction, resolved once (the hot path adds to them)
	sumStore, sumLoad prometheus.Counter
	diskKeys          DiskKeys // nil: disk keys are pool keys
}

// DiskKeys maps pool keys to the disk tier's persistent keys: a pool key
// may hold ids valid for one boot only (namespaces), a disk key outlives the
// boot. ToDisk's false: the key is not to be written to disk.
type DiskKeys interface {
	ToDisk(k messages.Key) (messages.Key, bool)
}

// UseDiskKeys sets the mapping to disk keys; call it before any engine is
// bound. (Keys the disk announces are disk keys: map them back there.)
func (s *Store) UseDiskKeys(k DiskKeys) { s.diskKeys = k }

func (s *Store) toDisk(k messages.Key) (messages.Key, bool) {
	if s.diskKeys == nil {
		return k, true
	}
	return s.diskKeys.ToDisk(k)
}

// New returns the store over arena, its pool cut into pages of pageBytes
// (hostpool.DefaultPageBytes when <= 0), with the disk tier d (nil: none).
func New(arena backend.Arena, pageBytes int64, d *disk.Disk, m *metrics.Pool) *Store {
	s := &Store{pool: hostpool.NewShared(int64(len(arena.Bytes())), pageBytes), arena: arena, disk: d, metrics: m,
		sumStore: m.ChecksumTime.WithLabelValues(backend.DeviceToHost.String()),
		sumLoad:  m.ChecksumTime.WithLabelValues(backend.HostToDevice.String())}
	s.pool.SetKeepVictims(d != nil)
	return s
}

// SetMaxChunks bounds the chunks the pool holds (hostpool.Pool.SetMaxChunks);
// call it before any engine is bound.
func (s *Store) SetMaxChunks(n int) { s.pool.SetMaxChunks(n) }

// Stats is the pool's usage.
func (s *Store) Stats() hostpool.Stats { return s.pool.Stats() }

// Waiting is how many pending keys have waiters and how many waiters
// the room queue holds (tests: hostpool.Shared.Waiting, RoomWaiting).
func (s *Store) Waiting() (keys, room int) { return s.pool.Waiting(), s.pool.RoomWaiting() }

// SetJournal sets the pool's journal (hostpool.Journal): every change to
// what is loadable, in order, with the engine that made it. Set it before
// the store is used.
func (s *Store) SetJournal(j hostpool.Journal) { s.pool.SetJournal(j) }

// Reannounce tells the journal again of every chunk host memory holds
// (hostpool.Shared.Reannounce).
func (s *Store) Reannounce() { s.pool.Reannounce() }

// Ready reports whether key can be loaded: stored in host memory, or on disk.
// A key on disk that is pending in host memory (another load is reading it
// back, or a store filling it) counts: a load of it waits for that copy to
// end (PrepareLoad's ErrPending) and then pins it or reads it back itself.
// A key pending in host memory only (a store's) does not: PROTOCOL.md
// "lookup" stops at it. An engine's lookup asks Engine.Ready, which checks
// the chunk's size too.
func (s *Store) Ready(key messages.Key) bool { return s.ready(key, 0) }

// ready is Ready; want > 0 also requires the chunk to be of want bytes.
func (s *Store) ready(key messages.Key, want int64) bool {
	if st, size := s.pool.Lookup(key); st == hostpool.Ready {
		return want <= 0 || size == want
	}
	if s.disk != nil {
		if dk, ok := s.toDisk(key); ok {
			size, _, ok := s.disk.Has(dk)
			// One the pool can never take is no hit (PrepareLoad drops it).
			return ok && size > 0 && s.Fits(size) && (want <= 0 || size == want)
		}
	}
	return false
}

// Fits reports whether a chunk of size bytes can be stored at all: an empty
// pool holds it (hostpool.Pool.Fits; not merely its bytes: a chunk just
// under the pool's size may need a page more than the pool has).
func (s *Store) Fits(size int64) bool { return s.pool.Fits(size) }

// HoldsEmpty is the pool's HoldsEmpty: whether it holds counts[i] chunks of
// sizes[i] bytes together when empty, by pages and by its chunk cap.
func (s *Store) HoldsEmpty(sizes, counts []int64) bool { return s.pool.HoldsEmpty(sizes, counts) }

// Engine is the store as one engine's copies use it: its layout and device.
type Engine struct {
	s   *Store
	id  string
	lay *sched.Layout
	dev backend.Attachment
}

// Engine binds the store to an engine's id, layout and device.
func (s *Store) Engine(id string, lay *sched.Layout, dev backend.Attachment) *Engine {
	return &Engine{s: s, id: id, lay: lay, dev: dev}
}

// Ready is Store.Ready for a load of this engine: a chunk held in host
// memory or on disk whose size is not its group's chunk size in the
// engine's layout is no hit, since the load refuses it (sizesMatch) and
// drops it.
func (e *Engine) Ready(key messages.Key) bool {
	_, _, g := sched.SplitKey(key)
	if g < 0 || g >= len(e.lay.Groups) {
		return false
	}
	return e.s.ready(key, e.lay.Groups[g].ChunkBytes)
}

// PrepareStore makes room for a decision's chunks. With a
// disk tier the evicted chunks' bytes are copied out here, before the job
// that reuses their room is submitted, and queued for the disk writer.
func (e *Engine) PrepareStore(keys []messages.Key, sizes []int64) (hostpool.Prepared, error) {
	var prep hostpool.Prepared
	err := e.PrepareStoreInto(&prep, keys, sizes)
	return prep, err
}

// HoldsEmpty is the pool's HoldsEmpty (sched.Bounded).
func (e *Engine) HoldsEmpty(sizes, counts []int64) bool { return e.s.pool.HoldsEmpty(sizes, counts) }

// PrepareStoreInto is PrepareStore writing over out (sched.Preparer; see
// hostpool.Pool.PrepareStoreInto).
func (e *Engine) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	err := e.s.pool.By(e.id).PrepareStoreInto(out, keys, sizes)
	if len(out.Victims) > 0 {
		e.spillFreeing(out)
	}
	return named(err)
}

// spillFreeing is spill for a decision's victims. If it panics (a bug in
// the disk tier or the key mapping), the room the decision was given is
// freed before the panic goes on: the decision never learns of it, so no
// job would complete it, and its keys would stay pending for good, held
// back from every request that offers them.
func (e *Engine) spillFreeing(out *hostpool.Prepared) {
	spilled := false
	defer func() {
		if !spilled {
			e.s.pool.By(e.id).CompleteStoreAt(out.Keys, out.Slots, nil) // no sums: failed, freed
		}
	}()
	e.spill(out.Victims)
	spilled = true
}

// named has the *hostpool.KeyError in err, if any, name its key as
// P.E.stored announces it (sched.WireKey: hash, then group), not as the
// pool keys it: a pool key starts with the node's number for the
// namespace, which no engine or router knows, so an error naming it would
// match no key the engine was told of. Every exported error of the store
// passes through it; the error's Key stays the pool key (the node waits
// on it: WaitPending). The pool's errors are new values per call, so
// setting Shown in place changes no one else's.
func named(err error) error {
	if err == nil {
		// Most calls (every decision and copy): errors.As's target escapes,
		// so declaring it would cost an allocation per call.
		return nil
	}
	var ke *hostpool.KeyError
	if errors.As(err, &ke) && ke.Shown == "" {
		ke.Shown = sched.WireKey(ke.Key)
	}
	return err
}

func (e *Engine) spill(victims []hostpool.Victim) {
	b := e.s.arena.Bytes()
	for _, v := range victims {
		dk, ok := e.s.toDisk(v.Key)
		if !ok {
			continue
		}
		if _, _, on := e.s.disk.Has(dk); on {
			continue // back from disk and evicted again: no copy for Spill to throw away
		}
		var n int64
		for _, x := range v.Extents {
			n += x.Len
		}
		if !e.s.disk.Takes(n) {
			continue // the writer is behind: no copy for Spill to throw away
		}
		data := make([]byte, 0, n)
		for _, x := range v.Extents {
			data = append(data, b[x.Off:x.Off+x.Len]...)
		}
		e.s.disk.Spill(e.id, dk, v.Sum, data)
	}
}

// PrepareLoad readies the keys of a load: pinned in host memory, or given
// room there to be read back from disk by the load's Copy. It returns the
// keys evicted from host memory to make that room. A key pending in host
// memory (another copy is filling it) fails it with hostpool.ErrPending
// naming that key, when every other key is loadable: the caller may wait
// for it (WaitPending) and try again.
func (e *Engine) PrepareLoad(keys []messages.Key) ([]messages.Key, error) {
	if e.s.disk == nil {
		return nil, named(e.s.pool.PrepareLoad(keys))
	}
	prep, err := e.s.pool.By(e.id).PrepareLoadFrom(keys, func(k messages.Key) (int64, bool) {
		dk, ok := e.s.toDisk(k)
		if !ok {
			return 0, false
		}
		size, _, ok := e.s.disk.Has(dk)
		if ok && (size <= 0 || !e.s.Fits(size)) {
			// Larger than the whole pool (a pool made smaller since it was
			// written) or empty: it can never be read back, and kept it
			// would fail every load of it as "no room". Dropped, a miss.
			e.s.disk.Drop(e.id, dk)
			return 0, false
		}
		return size, ok
	})
	e.spill(prep.Victims)
	return prep.Evicted, named(err)
}

// WaitPending wakes w once one of keys, pending in another copy, is no
// longer (hostpool.Shared.WaitPending): a request that found them pending
// retries then, not only when its backoff ends.
func (e *Engine) WaitPending(keys []messages.Key, w hostpool.Waker) { e.s.pool.WaitPending(keys, w) }

// WaitRoom queues w to be woken, in its turn, when copies or loads end and
// room may have freed (hostpool.Shared.WaitRoom).
func (e *Engine) WaitRoom(w hostpool.Waker, seen uint64) { e.s.pool.WaitRoom(w, seen) }
