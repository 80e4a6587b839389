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

// NewShared returns a shared pool of capacity slots.
func NewShared(capacity int) *Shared { return &Shared{pool: New(capacity)} }

func (s *Shared) PrepareStore(keys []messages.Key) (Prepared, error) {
	if s.full.Load() && len(keys) > 0 {
		return Prepared{}, errFull
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	prep, err := s.pool.PrepareStore(keys)
	s.full.Store(s.pool.full())
	return prep, err
}

var errFull = fmt.Errorf("%w: every slot is pending or pinned", ErrNoRoom)

func (s *Shared) CompleteStore(keys []messages.Key, ok bool) {
	s.mu.Lock()
	s.pool.CompleteStore(keys, ok)
	s.full.Store(s.pool.full())
	s.mu.Unlock()
}

// PrepareLoad pins keys and touches them: a prefix that is loaded is hot
// and should stay resident (LRU).
func (s *Shared) PrepareLoad(keys []messages.Key) ([]Slot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	slots, err := s.pool.PrepareLoad(keys)
	if err == nil {
		s.pool.Touch(keys)
	}
	s.full.Store(s.pool.full())
	return slots, err
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

func (s *Shared) Lookup(key messages.Key) (State, Slot) {
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

func (s *Shared) Capacity() int { return s.pool.Capacity() }
