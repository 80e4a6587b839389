package slicepool

import "sync"

// Pool is a pool of []T; its zero value is usable (New 0, Keep 0 keeps none).
type Pool[T any] struct {
	New, Keep int
	p         sync.Pool
}

// Get returns an empty slice.
func (p *Pool[T]) Get() []T {
	if s, ok := p.p.Get().(*[]T); ok {
		return (*s)[:0]
	}
	return make([]T, 0, p.New)
}

// Put offers s for reuse (kept only if 0 < cap(s) <= Keep).
func (p *Pool[T]) Put(s []T) {
	if c := cap(s); c > 0 && c <= p.Keep {
		s = s[:0]
		p.p.Put(&s)
	}
}
