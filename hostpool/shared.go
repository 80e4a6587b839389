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
	// page or slot, every chunk pending or pinned. PrepareStore then answers
	// ErrNoRoom without the lock: an overloaded node retries on every event,
	// and those retries must not queue on the mutex that completing copies
	// need to free room. (An offer whose keys are all present already is
	// told "no room" too while full; it is retried, and deduplicated, once
	// room frees.)
	full atomic.Bool
}

// NewShared returns a shared pool (see New).
func NewShared(bytes, pageBytes int64) *Shared { return &Shared{pool: New(bytes, pageBytes)} }

func (s *Shared) PrepareStore(keys []messages.Key, sizes []int64) (Prepared, error) {
	if s.full.Load() && len(keys) > 0 {
		return Prepared{}, errFull
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	prep, err := s.pool.PrepareStore(keys, sizes)
	s.full.Store(s.pool.full())
	return prep, err
}

var errFull = fmt.Errorf("%w: every chunk is pending or pinned", ErrNoRoom)

func (s *Shared) CompleteStore(keys []messages.Key, sums []uint32) {
	s.CompleteStoreAt(keys, nil, sums)
}

// CompleteStoreAt: see Pool.CompleteStoreAt.
func (s *Shared) CompleteStoreAt(keys []messages.Key, slots []int32, sums []uint32) {
	s.mu.Lock()
	s.pool.CompleteStoreAt(keys, slots, sums)
	s.full.Store(s.pool.full())
	s.mu.Unlock()
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
// All-or-nothing: a pending or unfetchable key is ErrNotReady, no room is
// ErrNoRoom, and then nothing changed. prep.Keys are the keys given room
// (each once); complete them with CompleteStorePinned (or CompleteStore(keys,
// nil)).
func (s *Shared) PrepareLoadFrom(keys []messages.Key, fetch func(messages.Key) (int64, bool)) (
	prep Prepared, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer func() { s.full.Store(s.pool.full()) }()
	var here, absent []messages.Key
	var sizes []int64
	for _, k := range keys {
		switch st, _ := s.pool.Lookup(k); {
		case st == Ready:
			here = append(here, k)
			continue
		case st == Absent:
			if size, ok := fetch(k); ok {
				absent, sizes = append(absent, k), append(sizes, size) // PrepareStore gives a repeat one room
				continue
			}
		}
		return Prepared{}, &KeyError{Key: k, Err: ErrNotReady}
	}
	// Pin what is here first: the room for the rest must not evict it.
	if err := s.pool.PrepareLoad(here); err != nil {
		return Prepared{}, err
	}
	if len(absent) > 0 {
		if prep, err = s.pool.prepareStore(absent, sizes, false); err != nil { // located again when copied
			s.pool.CompleteLoad(here)
			return Prepared{}, err
		}
	}
	s.pool.Touch(here)
	return prep, nil
}

// CompleteStorePinned completes fetched keys as ready, pinned (see
// Pool.CompleteStorePinned).
func (s *Shared) CompleteStorePinned(keys []messages.Key, sums []uint32) {
	s.mu.Lock()
	s.pool.CompleteStorePinned(keys, sums)
	s.full.Store(s.pool.full())
	s.mu.Unlock()
}

// SetKeepVictims: see Pool.SetKeepVictims.
func (s *Shared) SetKeepVictims(keep bool) {
	s.mu.Lock()
	s.pool.SetKeepVictims(keep)
	s.mu.Unlock()
}

// Drop removes a ready, unpinned key (see Pool.Drop).
func (s *Shared) Drop(key messages.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ok := s.pool.Drop(key)
	s.full.Store(s.pool.full())
	return ok
}

func (s *Shared) CompleteLoad(keys []messages.Key) {
	s.mu.Lock()
	s.pool.CompleteLoad(keys)
	s.full.Store(s.pool.full())
	s.mu.Unlock()
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

func (s *Shared) PageBytes() int64 { return s.pool.PageBytes() }
