package hostpool

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvactors/kvactors/messages"
)

// Shared is a Pool behind a mutex, for the request actors of every engine on a
// node. Each method is one short critical section over in-memory maps; no
// copy or I/O happens under the lock.
type Shared struct {
	mu   sync.Mutex
	pool *Pool
	// full is set, after every change, while nothing can be added: no free
	// page or slot, or the chunk cap reached (SetMaxChunks), and every chunk
	// pending or pinned. PrepareStore then answers
	// ErrNoRoom without the lock: an overloaded node retries on every event,
	// and those retries must not queue on the mutex that completing copies
	// need to free room. (An offer whose keys are all present already is
	// told "no room" too while full; it is retried, and deduplicated, once
	// room frees.)
	full atomic.Bool
	// journal, when set, is told every change to what is loadable, under
	// mu, in the order of the changes (see Journal).
	journal Journal
	// waiters are woken when their pending key's copy ends (WaitPending),
	// or pin it as it is made ready (*Pins: PinReadyOrPending); under mu.
	// Every key here is pending.
	waiters map[messages.Key][]Waker
	// room are the waiters for room (WaitRoom), first in first out from
	// roomHead; under mu. roomGen counts the changes that freed room or
	// made it evictable (roomFreed; written under mu, read without it by a
	// full pool's fast refusal).
	room     []Waker
	roomHead int
	roomGen  atomic.Uint64
}

// Journal is told, under the pool's lock and so in the order they happen,
// of the keys that became loadable (stored true: a store completed) and of
// those that stopped being loadable (stored false: evicted or dropped),
// with the engine whose operation made the change ("" when none was
// named). It runs under the lock: it must copy keys if it keeps them and
// return at once. A node turns it into kv_events published in this order,
// so a router applying them in order ends where the pool is (PROTOCOL.md,
// "kv_events").
type Journal func(stored bool, keys []messages.Key, engine string)

// SetJournal sets the journal (nil: none). Set it before the pool is used.
func (s *Shared) SetJournal(j Journal) {
	s.mu.Lock()
	s.journal = j
	s.mu.Unlock()
}

// note tells the journal of a change; under s.mu.
func (s *Shared) note(stored bool, keys []messages.Key, engine string) {
	if s.journal != nil && len(keys) > 0 {
		s.journal(stored, keys, engine)
	}
}

// Reannounce tells the journal again of every loadable key, as stored
// ("" for the engine), in one change at this point of the journal's order:
// a node whose published changes may have been lost (a NATS outage) states
// what the pool holds after a clear (PROTOCOL.md "kv_events"). Least
// recently used first; one pass over the pool under the lock.
func (s *Shared) Reannounce() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.journal == nil {
		return
	}
	keys := make([]messages.Key, 0, s.pool.Len()-s.pool.pending)
	for r := s.pool.head; r != none; r = s.pool.entries[r].next {
		keys = append(keys, s.pool.entries[r].key)
	}
	s.note(true, keys, "")
}

// By is the pool's changing operations on behalf of engine: the journal
// is told which engine made each change. A value: no allocation per call.
type By struct {
	s      *Shared
	engine string
}

// By returns the operations of engine.
func (s *Shared) By(engine string) By { return By{s: s, engine: engine} }

// NewShared returns a shared pool (see New).
func NewShared(bytes, pageBytes int64) *Shared { return &Shared{pool: New(bytes, pageBytes)} }

func (s *Shared) PrepareStore(keys []messages.Key, sizes []int64) (Prepared, error) {
	return s.By("").PrepareStore(keys, sizes)
}

func (s *Shared) PrepareStoreInto(out *Prepared, keys []messages.Key, sizes []int64) error {
	return s.By("").PrepareStoreInto(out, keys, sizes)
}

// PrepareStore: see Pool.PrepareStore; its evictions are journaled.
func (b By) PrepareStore(keys []messages.Key, sizes []int64) (Prepared, error) {
	var out Prepared
	err := b.PrepareStoreInto(&out, keys, sizes)
	return out, err
}

// PrepareStoreInto: see Pool.PrepareStoreInto; its evictions are journaled.
func (b By) PrepareStoreInto(out *Prepared, keys []messages.Key, sizes []int64) error {
	s := b.s
	gen := s.roomGen.Load() // before full: a change in between shows as a newer gen at WaitRoom
	if s.full.Load() && len(keys) > 0 {
		out.Reset()
		out.RoomGen = gen
		return errFull
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.pool.PrepareStoreInto(out, keys, sizes)
	out.RoomGen = s.roomGen.Load()
	s.note(false, out.Evicted, b.engine)
	s.full.Store(s.pool.full())
	return err
}

var errFull = fmt.Errorf("%w: every chunk is pending or pinned", ErrNoRoom)

func (s *Shared) CompleteStore(keys []messages.Key, sums []uint32) {
	s.By("").CompleteStoreAt(keys, nil, sums)
}

// CompleteStoreAt: see Pool.CompleteStoreAt.
func (s *Shared) CompleteStoreAt(keys []messages.Key, slots []int32, sums []uint32) {
	s.By("").CompleteStoreAt(keys, slots, sums)
}

// CompleteStore: see Pool.CompleteStore; the keys made ready are journaled.
func (b By) CompleteStore(keys []messages.Key, sums []uint32) { b.CompleteStoreAt(keys, nil, sums) }

// CompleteStoreAt: see Pool.CompleteStoreAt; the keys made ready are
// journaled.
func (b By) CompleteStoreAt(keys []messages.Key, slots []int32, sums []uint32) {
	wake(b.completeStoreAt(keys, slots, sums))
}

func (b By) completeStoreAt(keys []messages.Key, slots []int32, sums []uint32) []Waker {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock() // a panic (a bug) must not leave the pool locked for good
	ended := s.pool.CompleteStoreAt(keys, slots, sums)
	s.noteReady(b.engine)
	s.full.Store(s.pool.full())
	return append(s.endWaits(keys), s.roomFreed(ended)...) // each key ended is ready (evictable) or freed
}

// noteReady journals the keys the last completion made ready; under s.mu.
func (s *Shared) noteReady(engine string) {
	s.note(true, s.pool.madeReady, engine)
	clear(s.pool.madeReady) // the keys are the callers' strings
	s.pool.madeReady = s.pool.madeReady[:0]
}

// PrepareLoad pins keys and touches them: a prefix that is loaded is hot
// and should stay resident (LRU).
func (s *Shared) PrepareLoad(keys []messages.Key) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.pool.PrepareLoad(keys)
	if err == nil {
		s.pool.Touch(keys)
	}
	s.full.Store(s.pool.full())
	return err
}

// Located is where a job's chunks are (Extents: chunk i's are Chunk(i)),
// with Sums and States per chunk.
type Located struct {
	Extents
	Sums   []uint32
	States []State
	Slots  []int32 // the keys' entries when known (a store job's room); nil from Locate
}

// Locate finds every key (its extents, checksum and state) in one critical section; it
// reports the first key not present.
func (s *Shared) Locate(keys []messages.Key) (Located, error) {
	loc := Located{Extents: Extents{Ends: make([]int, 0, len(keys))}, Sums: make([]uint32, 0, len(keys)),
		States: make([]State, 0, len(keys))}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		var sum uint32
		var st State
		loc.Ext, sum, st = s.pool.locate(k, loc.Ext)
		if st == Absent {
			return loc, &KeyError{Key: k, Err: ErrNotReady}
		}
		loc.Ends = append(loc.Ends, len(loc.Ext))
		loc.Sums = append(loc.Sums, sum)
		loc.States = append(loc.States, st)
	}
	return loc, nil
}

// PrepareLoadFrom is PrepareLoad for a pool with a lower tier: keys that are
// absent here but that fetch finds (with their size) are given pending room
// to be read back into, the others must be ready and are pinned and touched.
// All-or-nothing: an unfetchable key is ErrNotReady, else a pending one
// ErrPending (another copy is filling it: wait for it and try again), no
// room is ErrNoRoom, and then nothing changed. prep.Keys are the keys given
// room (each once); complete them with CompleteStorePinned (or
// CompleteStore(keys, nil)).
func (s *Shared) PrepareLoadFrom(keys []messages.Key, fetch func(messages.Key) (int64, bool)) (
	prep Prepared, err error) {
	return s.By("").PrepareLoadFrom(keys, fetch)
}

// PrepareLoadFrom: see Shared.PrepareLoadFrom; the evictions that made
// room are journaled.
func (b By) PrepareLoadFrom(keys []messages.Key, fetch func(messages.Key) (int64, bool)) (
	prep Prepared, err error) {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock()
	defer func() { s.full.Store(s.pool.full()) }()
	var here, absent []messages.Key
	var sizes []int64
	var pending *KeyError
	for _, k := range keys {
		switch st, _ := s.pool.Lookup(k); {
		case st == Ready:
			here = append(here, k)
			continue
		case st == Pending:
			if pending == nil {
				pending = &KeyError{Key: k, Err: ErrPending}
			}
			continue
		case st == Absent:
			if size, ok := fetch(k); ok {
				absent, sizes = append(absent, k), append(sizes, size) // PrepareStore gives a repeat one room
				continue
			}
		}
		return Prepared{}, &KeyError{Key: k, Err: ErrNotReady}
	}
	if pending != nil {
		return Prepared{}, pending
	}
	// Pin what is here first: the room for the rest must not evict it.
	if err := s.pool.PrepareLoad(here); err != nil {
		return Prepared{}, err
	}
	if len(absent) > 0 {
		if err = s.pool.prepareStore(&prep, absent, sizes, false); err != nil { // located again when copied
			s.pool.CompleteLoad(here)
			return Prepared{}, err
		}
		s.note(false, prep.Evicted, b.engine)
	}
	s.pool.Touch(here)
	return prep, nil
}

// CompleteStorePinned completes fetched keys as ready, pinned (see
// Pool.CompleteStorePinned).
func (s *Shared) CompleteStorePinned(keys []messages.Key, sums []uint32) {
	s.By("").CompleteStorePinned(keys, sums)
}

// CompleteStorePinned: see Shared.CompleteStorePinned; the keys made
// ready are journaled.
func (b By) CompleteStorePinned(keys []messages.Key, sums []uint32) {
	wake(b.completeStorePinned(keys, sums))
}

func (b By) completeStorePinned(keys []messages.Key, sums []uint32) []Waker {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock() // the journal runs under it: see completeStoreAt
	s.pool.CompleteStorePinned(keys, sums)
	s.noteReady(b.engine)
	s.full.Store(s.pool.full())
	return s.endWaits(keys)
}

// SetMaxChunks: see Pool.SetMaxChunks; set it before the pool is used.
func (s *Shared) SetMaxChunks(n int) {
	s.mu.Lock()
	s.pool.SetMaxChunks(n)
	s.mu.Unlock()
}

// SetKeepVictims: see Pool.SetKeepVictims.
func (s *Shared) SetKeepVictims(keep bool) {
	s.mu.Lock()
	s.pool.SetKeepVictims(keep)
	s.mu.Unlock()
}

// Drop removes a ready, unpinned key (see Pool.Drop).
func (s *Shared) Drop(key messages.Key, sum uint32) bool { return s.By("").Drop(key, sum) }

// Drop: see Shared.Drop; a dropped key is journaled.
func (b By) Drop(key messages.Key, sum uint32) bool {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock()
	ok := s.pool.Drop(key, sum)
	if ok {
		s.note(false, []messages.Key{key}, b.engine)
	}
	s.full.Store(s.pool.full())
	return ok
}

func (s *Shared) CompleteLoad(keys []messages.Key) { wake(s.completeLoad(keys)) }

func (s *Shared) completeLoad(keys []messages.Key) []Waker {
	s.mu.Lock()
	defer s.mu.Unlock()
	unpinned := s.pool.CompleteLoad(keys)
	s.full.Store(s.pool.full())
	return s.roomFreed(unpinned) // evictable again; a pin still held frees nothing
}

// EndLoad ends a load's copy (done, failed or aborted) in one step: the
// keys it was given room to read back from disk and never filled (still
// pending) are freed, and every key it pinned is unpinned. In two steps,
// a key freed by the first could be stored again and pinned by another
// load before the second, whose unpin by key would then take that load's
// pin, leaving its chunk evictable under its copy. It wakes the loads
// waiting for the freed keys, and as many room waiters as keys it freed or
// left unpinned.
func (b By) EndLoad(keys []messages.Key) { wake(b.endLoad(keys)) }

func (b By) endLoad(keys []messages.Key) []Waker {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock()
	freed := s.pool.CompleteStore(keys, nil) // a failure: no key is made ready, nothing journaled
	freed += s.pool.CompleteLoad(keys)
	s.full.Store(s.pool.full())
	return append(s.endWaits(keys), s.roomFreed(freed)...)
}

func (s *Shared) Lookup(key messages.Key) (State, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool.Lookup(key)
}

func (s *Shared) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool.Stats()
}

func (s *Shared) Capacity() int64 { return s.pool.Capacity() }

// HoldsEmpty: see Pool.HoldsEmpty (no lock: it reads only what New set).
func (s *Shared) HoldsEmpty(sizes, counts []int64) bool { return s.pool.HoldsEmpty(sizes, counts) }

// Fits: see Pool.Fits (no lock: it reads only what New set).
func (s *Shared) Fits(size int64) bool { return s.pool.Fits(size) }

func (s *Shared) PageBytes() int64 { return s.pool.PageBytes() }
