package client

import (
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// sends tracks when this client last published to its node's subjects
// (P.E.*: batches, heartbeats, loads, register, lookup, unregister). After
// a node loss the frees wait a lease from the later of that and the node's
// last sign of life (checklist step 15): if only the engine's link failed,
// the node heard the engine until its last message reached it, and may copy
// until then plus its own rules.
//
// Each publish is recorded before it is sent, so a check that runs while it
// is in flight counts it. One the NATS client refused at once (its link
// down: Options sets no reconnect buffer) sent nothing and is dropped
// again, so a cut link's failing heartbeats do not postpone the frees.
// Safe for concurrent use: requests are sent without c.mu.
type sends struct {
	mu      sync.Mutex
	last    time.Time            // the latest begun publish not refused
	pending map[uint64]time.Time // begun, outcome not known yet
	next    uint64
}

// begin records a publish about to be sent at now; pass its id to end.
func (s *sends) begin(now time.Time) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pending == nil {
		s.pending = map[uint64]time.Time{}
	}
	s.next++
	s.pending[s.next] = now
	return s.next
}

// end records the publish's outcome: err is what the publish (or the
// request) returned.
func (s *sends) end(id uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.pending[id]
	if !ok {
		return
	}
	delete(s.pending, id)
	if !notSent(err) && at.After(s.last) {
		s.last = at
	}
}

// latest is when the last publish that may have left this client began
// (zero: none).
func (s *sends) latest() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.last
	for _, at := range s.pending {
		if at.After(t) {
			t = at
		}
	}
	return t
}

// notSent reports whether a publish's error proves the node did not get
// it: the NATS client refused it before writing it anywhere, or the server
// found no subscriber for it (no responders: a node that is not subscribed
// receives nothing; a dead node's heartbeats must not postpone the frees by
// a lease). Any other error (a request's timeout) may come after the node
// took it.
func notSent(err error) bool {
	return errors.Is(err, nats.ErrReconnectBufExceeded) || errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrConnectionDraining) || errors.Is(err, nats.ErrMaxPayload) ||
		errors.Is(err, nats.ErrNoResponders)
}
