package hostpool

import (
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/messages"
)

// Slot is the index of a chunk-sized slot in the pool arena.
type Slot int32

// State of a key in the pool.
type State uint8

const (
	Absent  State = iota // not in the pool
	Pending              // a store copy is filling its slot; not loadable
	Ready                // stored and loadable
)

var stateNames = [...]string{"absent", "pending", "ready"}

func (s State) String() string { return stateNames[s] }

// Errors returned by the pool; check with errors.Is.
var (
	// ErrNoRoom means PrepareStore could not free enough slots: every
	// evictable slot is pending, pinned or among the offered keys. Nothing
	// changed; the caller retries later (PROTOCOL.md: "a retry").
	ErrNoRoom = errors.New("hostpool: no room")
	// ErrNotReady means a key asked for by a load is absent or pending.
	ErrNotReady = errors.New("hostpool: key not ready")
)

// Prepared is the outcome of a successful PrepareStore. Keys[i] is to be
// copied into Slots[i]; keys already present (ready or pending) are left out.
// An empty Keys with a nil error is "nothing to store", distinct from ErrNoRoom.
type Prepared struct {
	Keys    []messages.Key
	Slots   []Slot
	Evicted []messages.Key // ready keys evicted to make room, oldest first
}

type entry struct {
	key        messages.Key
	slot       Slot
	state      State
	pins       int32
	prev, next *entry // LRU list links; only ready entries are linked
}

// Pool tracks capacity slots. The zero value is not usable; call New.
type Pool struct {
	capacity int
	fresh    int    // slots [fresh, capacity) were never used
	free     []Slot // released slots, reused last-in-first-out
	entries  map[messages.Key]*entry
	// LRU list of ready entries: head is least recently used.
	head, tail *entry
	pending    int
	pinned     int
}

// New returns a pool of capacity slots (capacity >= 0).
func New(capacity int) *Pool {
	if capacity < 0 {
		capacity = 0
	}
	return &Pool{capacity: capacity, entries: make(map[messages.Key]*entry)}
}

// Capacity is the number of slots.
func (p *Pool) Capacity() int { return p.capacity }

// Len is the number of keys present, pending or ready.
func (p *Pool) Len() int { return len(p.entries) }

// Stats is a point-in-time view of the pool.
type Stats struct {
	Capacity int `json:"capacity"`
	Used     int `json:"used"`
	Pending  int `json:"pending"`
	Ready    int `json:"ready"`
	Pinned   int `json:"pinned"`
	Free     int `json:"free"`
}

// Stats reports slot usage.
func (p *Pool) Stats() Stats {
	used := len(p.entries)
	return Stats{Capacity: p.capacity, Used: used, Pending: p.pending,
		Ready: used - p.pending, Pinned: p.pinned, Free: p.capacity - used}
}

// Lookup returns the state of key and its slot (valid unless Absent).
func (p *Pool) Lookup(key messages.Key) (State, Slot) {
	e, ok := p.entries[key]
	if !ok {
		return Absent, -1
	}
	return e.state, e.slot
}

// PrepareStore allocates slots for the keys not yet present. It is
// all-or-nothing: when room cannot be made it returns ErrNoRoom and changes
// nothing. Room comes from never-used slots first, then released slots
// (newest first), then by evicting least recently used ready keys that are
// neither pinned nor among keys (an offered key is never evicted to make room
// for its siblings). New keys start Pending.
func (p *Pool) PrepareStore(keys []messages.Key) (Prepared, error) {
	offered := newKeySet(keys)
	var toStore []messages.Key
	for i, k := range keys {
		if _, ok := p.entries[k]; ok || offered.firstIndex(k) != i {
			continue // dedup: present (ready or pending) or offered twice
		}
		toStore = append(toStore, k)
	}
	if len(toStore) == 0 {
		return Prepared{}, nil
	}
	avail := p.capacity - p.fresh + len(p.free)
	var victims []*entry
	for e := p.head; e != nil && avail+len(victims) < len(toStore); e = e.next {
		if e.pins == 0 && offered.firstIndex(e.key) < 0 {
			victims = append(victims, e)
		}
	}
	if avail+len(victims) < len(toStore) {
		return Prepared{}, fmt.Errorf("%w: %d slots needed, %d free, %d evictable", ErrNoRoom,
			len(toStore), avail, len(victims))
	}
	out := Prepared{Keys: toStore, Slots: make([]Slot, 0, len(toStore))}
	for _, e := range victims {
		p.unlink(e)
		delete(p.entries, e.key)
		p.free = append(p.free, e.slot)
		out.Evicted = append(out.Evicted, e.key)
	}
	for _, k := range toStore {
		var s Slot
		if p.fresh < p.capacity {
			s = Slot(p.fresh)
			p.fresh++
		} else {
			s = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		}
		p.entries[k] = &entry{key: k, slot: s, state: Pending}
		p.pending++
		out.Slots = append(out.Slots, s)
	}
	return out, nil
}

// CompleteStore ends the copies of keys. On success pending keys become ready
// (most recently used). On failure pending keys are removed and their slots
// freed; ready keys are never affected by a failure (another job stored them).
func (p *Pool) CompleteStore(keys []messages.Key, ok bool) {
	for _, k := range keys {
		e, found := p.entries[k]
		if !found || e.state != Pending {
			continue
		}
		p.pending--
		if ok {
			e.state = Ready
			p.pushBack(e)
			continue
		}
		delete(p.entries, k)
		p.free = append(p.free, e.slot)
	}
}

// PrepareLoad pins every key so it cannot be evicted while its bytes are
// copied out, and returns their slots. All keys must be ready; otherwise it
// returns an error naming the first key that is not (ErrNotReady) and pins
// nothing.
func (p *Pool) PrepareLoad(keys []messages.Key) ([]Slot, error) {
	slots := make([]Slot, len(keys))
	for i, k := range keys {
		e, ok := p.entries[k]
		if !ok || e.state != Ready {
			return nil, &KeyError{Key: k, Err: ErrNotReady}
		}
		slots[i] = e.slot
	}
	for _, k := range keys {
		e := p.entries[k]
		if e.pins == 0 {
			p.pinned++
		}
		e.pins++
	}
	return slots, nil
}

// CompleteLoad unpins keys pinned by PrepareLoad.
func (p *Pool) CompleteLoad(keys []messages.Key) {
	for _, k := range keys {
		if e, ok := p.entries[k]; ok && e.pins > 0 {
			e.pins--
			if e.pins == 0 {
				p.pinned--
			}
		}
	}
}

// Touch marks ready keys as most recently used. Like vLLM it walks them in
// reverse, so the first key of a prefix ends up the most recent and a prefix
// is evicted from its tail first.
func (p *Pool) Touch(keys []messages.Key) {
	for i := len(keys) - 1; i >= 0; i-- {
		if e, ok := p.entries[keys[i]]; ok && e.state == Ready {
			p.unlink(e)
			p.pushBack(e)
		}
	}
}

// KeyError names the key an operation failed on.
type KeyError struct {
	Key messages.Key
	Err error
}

func (e *KeyError) Error() string { return fmt.Sprintf("key %x: %v", string(e.Key), e.Err) }
func (e *KeyError) Unwrap() error { return e.Err }

func (p *Pool) pushBack(e *entry) {
	e.prev, e.next = p.tail, nil
	if p.tail != nil {
		p.tail.next = e
	} else {
		p.head = e
	}
	p.tail = e
}

func (p *Pool) unlink(e *entry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		p.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		p.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

// keySet answers "is k offered, and where first" for PrepareStore. Offered
// lists are usually one request's few new chunks, where a linear scan beats
// building a map; long prompts stored at once get the map.
type keySet struct {
	keys []messages.Key
	idx  map[messages.Key]int
}

const keySetScanMax = 16

func newKeySet(keys []messages.Key) keySet {
	s := keySet{keys: keys}
	if len(keys) > keySetScanMax {
		s.idx = make(map[messages.Key]int, len(keys))
		for i := len(keys) - 1; i >= 0; i-- {
			s.idx[keys[i]] = i
		}
	}
	return s
}

// firstIndex is the index of k's first occurrence, or -1.
func (s keySet) firstIndex(k messages.Key) int {
	if s.idx != nil {
		if i, ok := s.idx[k]; ok {
			return i
		}
		return -1
	}
	for i, x := range s.keys {
		if x == k {
			return i
		}
	}
	return -1
}
