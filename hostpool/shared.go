package hostpool

import (
	"sync"

	"github.com/kvactors/kvactors/messages"
)

// Shared is a Pool behind a mutex, for the request actors of every engine on a
// node. Each method is one short critical section over in-memory maps; no
// copy or I/O happens under the lock.
type Shared struct {
	mu   sync.Mutex
	pool *Pool
}

// NewShared returns a shared pool of capacity slots.
func NewShared(capacity int) *Shared { return &Shared{pool: New(capacity)} }

func (s *Shared) PrepareStore(keys []messages.Key) (Prepared, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool.PrepareStore(keys)
}

func (s *Shared) CompleteStore(keys []messages.Key, ok bool) {
	s.mu.Lock()
	s.pool.CompleteStore(keys, ok)
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
	return slots, err
}

func (s *Shared) CompleteLoad(keys []messages.Key) {
	s.mu.Lock()
	s.pool.CompleteLoad(keys)
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
