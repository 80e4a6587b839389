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
	// full is set, after every change, while every slot is pending or
	// pinned. PrepareStore then answers ErrNoRoom without the lock: an
	// overloaded node retries on every event, and those retries must not
	// queue on the mutex that completing copies need to free slots. (An
	// offer whose keys are all present already is told "no room" too while
	// full; it is retried, and deduplicated, once a slot frees.)
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

var errFull = fmt.Errorf("%w: every slot is pending or pinned", ErrNoRoom)

func (s *Shared) CompleteStore(keys []messages.Key, sums []uint32) {
	s.mu.Lock()
	s.pool.CompleteStore(keys, sums)
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

// Locate appends the extents of each key to dst (see Pool.Locate) in one
// critical section, and each key's checksum to sums; it reports the first
// key not present.
func (s *Shared) Locate(keys []messages.Key, dst []Extent, ends []int, sums []uint32) ([]Extent, []int, []uint32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		var sum uint32
		var ok bool
		dst, sum, ok = s.pool.Locate(k, dst)
		if !ok {
			return dst, ends, sums, &KeyError{Key: k, Err: ErrNotReady}
		}
		ends = append(ends, len(dst))
		sums = append(sums, sum)
	}
	return dst, ends, sums, nil
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

func (s *Shared) Touch(keys []messages.Key) {
	s.mu.Lock()
	s.pool.Touch(keys)
	s.mu.Unlock()
}

func (s *Shared) Lookup(key messages.Key) (State, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool.Lookup(key)
}

// ReadyPrefix counts the leading keys that are ready, stopping at the first
// absent or pending one (a lookup hit must be loadable now).
func (s *Shared) ReadyPrefix(keys []messages.Key) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if st, _ := s.pool.Lookup(k); st != Ready {
			return i
		}
	}
	return len(keys)
}

func (s *Shared) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool.Stats()
}

func (s *Shared) Capacity() int64 { return s.pool.Capacity() }

func (s *Shared) PageBytes() int64 { return s.pool.PageBytes() }
