package hostpool

import (
	"slices"

	"github.com/kvactors/kvactors/messages"
)

// A Waker is told that a key it waits for (WaitPending) is no longer
// pending: the copy that filled it completed, failed or was cancelled.
// Wake runs on the goroutine that ended the copy, after the pool's lock is
// released; it must return at once (a request actor's sends a message).
type Waker interface{ Wake() }

// Signal is a Waker that never blocks, for a goroutine that waits on it:
// one wake-up is kept until it is taken, more are the same one. It is
// comparable, so WaitPending keeps it once per key however often it is
// registered again.
type Signal chan struct{}

// NewSignal returns a Signal ready to wake.
func NewSignal() Signal { return make(Signal, 1) }

func (s Signal) Wake() {
	select {
	case s <- struct{}{}:
	default:
	}
}

// WaitPending wakes w once any of keys stops being pending. A decision that
// found a key pending in another copy holds its chunk back until that copy
// ends (it may fail and leave the chunk to this request to store), and a
// timer alone would make it wait out the whole backoff after a copy of a
// few hundred microseconds. If one of keys is already not pending (its copy
// ended between the decision and this call), w is woken now and nothing is
// kept; otherwise w is kept on each of keys until the first of them ends
// (the others drop it when they end). Waking more than once, or after the
// waiter lost interest, must be harmless to w.
func (s *Shared) WaitPending(keys []messages.Key, w Waker) {
	if len(keys) == 0 {
		return
	}
	s.mu.Lock()
	now := false
	for _, k := range keys {
		if st, _ := s.pool.Lookup(k); st != Pending {
			now = true
			break
		}
	}
	if !now {
		if s.waiters == nil {
			s.waiters = make(map[messages.Key][]Waker)
		}
		for _, k := range keys {
			ws := s.waiters[k]
			if !containsWaker(ws, w) {
				s.waiters[k] = append(ws, w)
			}
		}
	}
	s.mu.Unlock()
	if now {
		w.Wake()
	}
}

// Waiting is how many keys have a waiter (tests, and a bound worth watching:
// every entry is a pending key, so it never exceeds Stats().Pending).
func (s *Shared) Waiting() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiters)
}

// endWaits takes the waiters of those of keys that are no longer pending,
// each waker once; under s.mu. With nobody waiting (almost always) it costs
// one length check.
func (s *Shared) endWaits(keys []messages.Key) []Waker {
	if len(s.waiters) == 0 {
		return nil
	}
	var woken []Waker
	pinned := false
	for _, k := range keys {
		ws, ok := s.waiters[k]
		if !ok {
			continue
		}
		st, _ := s.pool.Lookup(k)
		if st == Pending {
			continue // not this key's copy that ended (a caller completing a key twice)
		}
		delete(s.waiters, k)
		for _, w := range ws {
			if p, ok := w.(*Pins); ok {
				// Pinned in the step that made it ready: no eviction
				// comes between (PinReadyOrPending).
				if !p.done && st == Ready {
					p.keys = append(p.keys, s.pool.PinReady([]messages.Key{k})...)
					pinned = true
				}
				continue
			}
			if !containsWaker(woken, w) {
				woken = append(woken, w)
			}
		}
	}
	if pinned {
		s.full.Store(s.pool.full())
	}
	return woken
}

// Pins are the pins PinReadyOrPending takes for one holder. Unpin lets go
// of them.
type Pins struct {
	keys []messages.Key // pinned, once per pin; under the Shared's mu
	done bool           // unpinned: a key pending still pins nothing for it
}

// Wake does nothing: Pins are kept on pending keys only for endWaits,
// which pins them.
func (*Pins) Wake() {}

// PinReadyOrPending pins those of keys that are ready (once each time
// given, as Pool.PinReady), and each that is pending (another copy filling
// it) in the step its copy makes it ready: a remote load's own local
// chunks, evictable by no store while it fetches the others, including one
// whose copy ends during the fetch. Unpin lets go of every pin taken, and
// of those still to come.
func (s *Shared) PinReadyOrPending(keys []messages.Key) *Pins {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := &Pins{keys: s.pool.PinReady(keys)}
	for _, k := range keys {
		if st, _ := s.pool.Lookup(k); st == Pending {
			if s.waiters == nil {
				s.waiters = make(map[messages.Key][]Waker)
			}
			if ws := s.waiters[k]; !containsWaker(ws, p) {
				s.waiters[k] = append(ws, p)
			}
		}
	}
	s.full.Store(s.pool.full())
	return p
}

// Unpin lets go of p's pins (they stay, evictable again unless another
// holder pins them), and p pins no key whose copy ends later.
func (s *Shared) Unpin(p *Pins) { wake(s.unpin(p)) }

func (s *Shared) unpin(p *Pins) []Waker {
	s.mu.Lock()
	p.done = true // endWaits pins nothing more for it
	keys := p.keys
	p.keys = nil
	s.mu.Unlock()
	return s.completeLoad(keys)
}

func wake(ws []Waker) {
	for _, w := range ws {
		w.Wake()
	}
}

func containsWaker(ws []Waker, w Waker) bool {
	for _, x := range ws {
		if x == w {
			return true
		}
	}
	return false
}

// maxRoomWaiters bounds the room queue: a registration past it is not kept
// (its waiter falls back on its own timer). Stale registrations (a waiter
// that found room by other means) stay until woken, harmlessly.
const maxRoomWaiters = 1 << 16

// WaitRoom queues w to be woken when a copy ends or a load lets go of its
// pins: a decision that found no room (every chunk pending or pinned, or
// none evictable that fits) retries then, not only when its backoff ends.
// Waiters are woken first in, first out, as many per change as the keys it
// freed or made evictable, so a burst into a full pool is served in the
// order it queued rather than by whichever retry timer falls due as room
// appears (under a 10 ms-doubling backoff the unlucky ones backed off to a
// second at a time and starved). seen is the decision's Prepared.RoomGen:
// if room may have freed since (a change between the decision and this
// call, whose wake-up found nobody queued), w is woken now instead; it is
// never woken now for an unchanged pool, where a decision that cannot fit
// would spin.
func (s *Shared) WaitRoom(w Waker, seen uint64) {
	s.mu.Lock()
	changed := s.roomGen.Load() != seen
	if !changed && len(s.room)-s.roomHead < maxRoomWaiters {
		s.room = append(s.room, w)
	}
	s.mu.Unlock()
	if changed {
		w.Wake()
	}
}

// A StaleWaker can tell that it no longer waits (its waiter went on by
// other means): the room queue passes its turn to the next waiter.
type StaleWaker interface {
	Waker
	Stale() bool
}

// roomFreed records a change that freed n keys' room or made it evictable
// (a new room generation, for WaitRoom) and takes the waiters it wakes; a
// change that freed nothing is no change to a decision that found no room.
// Under s.mu.
func (s *Shared) roomFreed(n int) []Waker {
	if n <= 0 {
		return nil
	}
	s.roomGen.Add(1)
	return s.takeRoom(n)
}

// takeRoom takes up to n waiters that still wait from the front of the
// room queue, dropping stale ones on the way; under s.mu.
func (s *Shared) takeRoom(n int) []Waker {
	if n <= 0 || s.roomHead == len(s.room) {
		return nil
	}
	var woken []Waker
	for ; len(woken) < n && s.roomHead < len(s.room); s.roomHead++ {
		w := s.room[s.roomHead]
		s.room[s.roomHead] = nil
		if sw, ok := w.(StaleWaker); ok && sw.Stale() {
			continue
		}
		woken = append(woken, w)
	}
	if s.roomHead == len(s.room) {
		s.room, s.roomHead = s.room[:0], 0
	} else if s.roomHead > len(s.room)/2 && s.roomHead > 1024 {
		s.room = slices.Delete(s.room, 0, s.roomHead) // compact the taken front
		s.roomHead = 0
	}
	return woken
}

// RoomWaiting is how many waiters the room queue holds (tests).
func (s *Shared) RoomWaiting() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.room) - s.roomHead
}
