package slicepool

import "sync"

// Pool is a pool of []T; its zero value is usable (New 0, Keep 0 keeps none).
type Pool[T any] struct {
	New, Keep int
	p         sync.Pool // *[]T holding a slice to hand out
	// boxes keeps the *[]T that Get emptied, for Put to fill again: a
	// sync.Pool holds pointers, and boxing each Put's slice afresh was a
	// heap allocation per Put (per batch, on the event path).
	boxes sync.Pool
}

// Get returns an empty slice.
func (p *Pool[T]) Get() []T {
	if b, ok := p.p.Get().(*[]T); ok {
		s := (*b)[:0]
		*b = nil // the box holds nothing while it waits
		p.boxes.Put(b)
		return s
	}
	return make([]T, 0, p.New)
}

// Put offers s for reuse (kept only if 0 < cap(s) <= Keep).
func (p *Pool[T]) Put(s []T) {
	if c := cap(s); c > 0 && c <= p.Keep {
		b, ok := p.boxes.Get().(*[]T)
		if !ok {
			b = new([]T)
		}
		*b = s[:0]
		p.p.Put(b)
	}
}
