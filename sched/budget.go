package sched

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/kvactors/kvactors/messages"
)

// ErrStateBudget: the event would make the engine's live requests hold
// more bytes of hashes and block ids than its StateBudget allows
// (PROTOCOL.md "Isolation", bounds). Counted as "limit".
var ErrStateBudget = messages.NewRejection(messages.RejectLimit, "engine's request state past --max-request-state-bytes")

// StateBudget bounds the bytes one engine's live requests hold of their
// hashes and block ids, together. max_model_len bounds each request and
// --max-requests their count, but not their product: 65536 requests of 1Mi
// hashes each would hold terabytes. A budget is shared by the engine's
// request actors, each on its own goroutine, so it is safe for concurrent
// use. A nil *StateBudget bounds nothing.
//
// What a request is charged is what it keeps reachable: the capacity of its
// hash and block id lists (a hash's string header included) and its hashes'
// bytes. Lists grow as append grows them, so a request may hold up to
// twice what its ids need; the charge says so rather than hide it.
type StateBudget struct {
	limit int64
	held  atomic.Int64
}

// NewStateBudget returns a budget of limit bytes (≤ 0: no bound, only
// counted).
func NewStateBudget(limit int64) *StateBudget {
	return &StateBudget{limit: limit}
}

// Held is what the engine's requests hold now, in bytes.
func (b *StateBudget) Held() int64 {
	if b == nil {
		return 0
	}
	return b.held.Load()
}

// Limit is the bound (≤ 0: none).
func (b *StateBudget) Limit() int64 {
	if b == nil {
		return 0
	}
	return b.limit
}

// take charges n bytes, or reports false and charges nothing if that would
// pass the limit.
func (b *StateBudget) take(n int64) bool {
	if b == nil || n == 0 {
		return true
	}
	for {
		cur := b.held.Load()
		if b.limit > 0 && cur+n > b.limit {
			return false
		}
		if b.held.CompareAndSwap(cur, cur+n) {
			break
		}
	}
	return true
}

// give returns n bytes.
func (b *StateBudget) give(n int64) {
	if b == nil || n == 0 {
		return
	}
	b.held.Add(-n)
}

// The heap a request's lists cost per element.
const (
	hashHeaderBytes = int64(unsafe.Sizeof(messages.Hash("")))
	blockIDBytes    = int64(unsafe.Sizeof(messages.BlockID(0)))
)

// StateBytes is what the request is charged now.
func (r *Request) StateBytes() int64 { return r.charged }

// Forget gives the request's charge back: its owner drops the state (its
// final release, or its actor's end). The request must not be used after.
func (r *Request) Forget() {
	r.lay.Budget.give(r.charged)
	r.charged = 0
}

// charge takes n bytes from the budget for a growth of the request's lists.
func (r *Request) charge(n int64) error {
	if !r.lay.Budget.take(n) {
		return fmt.Errorf("%w: %d bytes more, the engine's requests hold %d of %d",
			ErrStateBudget, n, r.lay.Budget.Held(), r.lay.Budget.Limit())
	}
	r.charged += n
	return nil
}

// uncharge gives n bytes back (a list dropped).
func (r *Request) uncharge(n int64) {
	r.lay.Budget.give(n)
	r.charged -= n
}

// growCharged returns s with room for end elements (grownCap), charging
// the capacity it grows by (elem bytes each) and extra bytes together:
// refused, nothing is charged and s is returned as it was. Grown, the
// elements go to a fresh array.
func growCharged[T any](r *Request, s []T, end, presize, most int, elem, extra int64) ([]T, error) {
	c := cap(s)
	grown := c
	if end > c {
		grown = grownCap(c, end, presize, most, s == nil)
	}
	if err := r.charge(extra + int64(grown-c)*elem); err != nil {
		return s, err
	}
	if grown > c {
		s = append(make([]T, 0, grown), s...)
	}
	return s, nil
}

// bytesOf is the bytes of ss's strings (a hash's, a key's): what a list of
// them keeps reachable besides its headers.
func bytesOf[S ~string](ss []S) int64 {
	var n int64
	for _, s := range ss {
		n += int64(len(s))
	}
	return n
}

// grownCap is the capacity a list of capacity c, nil when fresh, takes to
// hold end elements: first the presized room, then as append grows (twice
// below 256 elements, then by a quarter and 192 more), never past most (a
// request's bound: room past it could never be used).
func grownCap(c, end, presize, most int, fresh bool) int {
	switch {
	case fresh:
		c = max(end, presize)
	case c < 256:
		c = max(end, 2*c)
	default:
		c = max(end, c+(c+3*256)/4)
	}
	return min(c, most)
}
