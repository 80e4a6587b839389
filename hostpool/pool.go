package hostpool

import (
	"errors"
	"fmt"
	"slices"

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

// entry is one slot's bookkeeping. Entries live in a slab indexed by slot,
// so storing a key allocates nothing but its map entry.
type entry struct {
	key   messages.Key
	state State
	pins  int32
	mark  uint32 // == Pool.epoch while offered in the running PrepareStore
	// LRU links by slot (none: -1); only ready entries are linked.
	prev, next Slot
}

// none is the null slot link.
const none Slot = -1

// dedupMax: when room is short, an offer of up to this many keys is checked
// for repeats (a repeat needs no second slot) by a scan; a longer one counts
// repeats as new keys. A repeated key means two chunks with one last hash,
// which a chained-hash engine never sends, and an overloaded node meets "no
// room" on every event, where a set per call would cost a tenth of its CPU.
const dedupMax = 32

// distinctNew counts the distinct keys not in index, by an O(n²) scan of a
// short offer.
func distinctNew(keys []messages.Key, index map[messages.Key]Slot) int {
	n := 0
	for i, k := range keys {
		if _, ok := index[k]; ok || slices.Contains(keys[:i], k) {
			continue
		}
		n++
	}
	return n
}

// Pool tracks capacity slots. The zero value is not usable; call New.
type Pool struct {
	capacity int
	fresh    int    // slots [fresh, capacity) were never used
	free     []Slot // released slots, reused last-in-first-out
	slots    []entry
	index    map[messages.Key]Slot
	// LRU list of ready entries: head is least recently used.
	head, tail Slot
	pending    int
	pinned     int
	epoch      uint32
	victims    []Slot // scratch of PrepareStore
}

// New returns a pool of capacity slots (capacity >= 0).
func New(capacity int) *Pool {
	if capacity < 0 {
		capacity = 0
	}
	return &Pool{capacity: capacity, index: make(map[messages.Key]Slot), head: none, tail: none}
}

// full reports whether every slot is pending or pinned: no key can be added.
func (p *Pool) full() bool {
	return p.capacity-p.fresh+len(p.free) == 0 && len(p.index)-p.pending-p.pinned == 0
}

// Capacity is the number of slots.
func (p *Pool) Capacity() int { return p.capacity }

// Len is the number of keys present, pending or ready.
func (p *Pool) Len() int { return len(p.index) }

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
	used := len(p.index)
	return Stats{Capacity: p.capacity, Used: used, Pending: p.pending,
		Ready: used - p.pending, Pinned: p.pinned, Free: p.capacity - used}
}

// Lookup returns the state of key and its slot (valid unless Absent).
func (p *Pool) Lookup(key messages.Key) (State, Slot) {
	sl, ok := p.index[key]
	if !ok {
		return Absent, -1
	}
	return p.slots[sl].state, sl
}

// PrepareStore allocates slots for the keys not yet present. It is
// all-or-nothing: when room cannot be made it returns ErrNoRoom and changes
// nothing. Room comes from never-used slots first, then released slots
// (newest first), then by evicting least recently used ready keys that are
// neither pinned nor among keys (an offered key is never evicted to make room
// for its siblings). New keys start Pending.
//
// Duplicate keys in one offer are stored once (see dedupMax for how they
// count when room is short).
func (p *Pool) PrepareStore(keys []messages.Key) (Prepared, error) {
	p.epoch++
	if p.epoch == 0 { // wrapped: no mark may look current
		for i := range p.slots {
			p.slots[i].mark = 0
		}
		p.epoch = 1
	}
	// Mark offered keys that are present (they must not be evicted for their
	// siblings) and count the new ones. No map changes yet: "no room" must
	// cost little, since an overloaded node meets it on every event.
	need := 0
	for _, k := range keys {
		if sl, ok := p.index[k]; ok {
			p.slots[sl].mark = p.epoch
			continue
		}
		need++
	}
	if need == 0 {
		return Prepared{}, nil
	}
	avail := p.capacity - p.fresh + len(p.free)
	victims := p.victims[:0]
	for sl := p.head; sl != none && avail+len(victims) < need; sl = p.slots[sl].next {
		if e := &p.slots[sl]; e.pins == 0 && e.mark != p.epoch {
			victims = append(victims, sl)
		}
	}
	p.victims = victims[:0]
	if avail+len(victims) < need && (len(keys) > dedupMax || avail+len(victims) < distinctNew(keys, p.index)) {
		return Prepared{}, fmt.Errorf("%w: %d slots needed, %d free, %d evictable", ErrNoRoom,
			need, avail, len(victims))
	}
	out := Prepared{Keys: make([]messages.Key, 0, need), Slots: make([]Slot, 0, need)}
	for _, k := range keys {
		if _, ok := p.index[k]; ok {
			continue // present, or a repeat already given a slot
		}
		var sl Slot
		switch {
		case p.fresh < p.capacity:
			sl = Slot(p.fresh)
			p.fresh++
			p.slots = append(p.slots, entry{})
		case len(p.free) > 0:
			sl = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		default: // evict the least recently used candidate, only as needed
			sl, victims = victims[0], victims[1:]
			e := &p.slots[sl]
			p.unlink(sl)
			delete(p.index, e.key)
			out.Evicted = append(out.Evicted, e.key)
		}
		p.slots[sl] = entry{key: k, state: Pending, prev: none, next: none}
		p.index[k] = sl
		p.pending++
		out.Keys = append(out.Keys, k)
		out.Slots = append(out.Slots, sl)
	}
	return out, nil
}

// CompleteStore ends the copies of keys. On success pending keys become ready
// (most recently used). On failure pending keys are removed and their slots
// freed; ready keys are never affected by a failure (another job stored them).
func (p *Pool) CompleteStore(keys []messages.Key, ok bool) {
	for _, k := range keys {
		sl, found := p.index[k]
		if !found || p.slots[sl].state != Pending {
			continue
		}
		p.pending--
		if ok {
			p.slots[sl].state = Ready
			p.pushBack(sl)
			continue
		}
		delete(p.index, k)
		p.slots[sl].key = ""
		p.free = append(p.free, sl)
	}
}

// PrepareLoad pins every key so it cannot be evicted while its bytes are
// copied out, and returns their slots. All keys must be ready; otherwise it
// returns an error naming the first key that is not (ErrNotReady) and pins
// nothing.
func (p *Pool) PrepareLoad(keys []messages.Key) ([]Slot, error) {
	slots := make([]Slot, len(keys))
	for i, k := range keys {
		sl, ok := p.index[k]
		if !ok || p.slots[sl].state != Ready {
			return nil, &KeyError{Key: k, Err: ErrNotReady}
		}
		slots[i] = sl
	}
	for _, sl := range slots {
		e := &p.slots[sl]
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
		if sl, ok := p.index[k]; ok && p.slots[sl].pins > 0 {
			e := &p.slots[sl]
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
		if sl, ok := p.index[keys[i]]; ok && p.slots[sl].state == Ready {
			p.unlink(sl)
			p.pushBack(sl)
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

func (p *Pool) pushBack(sl Slot) {
	e := &p.slots[sl]
	e.prev, e.next = p.tail, none
	if p.tail != none {
		p.slots[p.tail].next = sl
	} else {
		p.head = sl
	}
	p.tail = sl
}

func (p *Pool) unlink(sl Slot) {
	e := &p.slots[sl]
	if e.prev != none {
		p.slots[e.prev].next = e.next
	} else if p.head == sl {
		p.head = e.next
	}
	if e.next != none {
		p.slots[e.next].prev = e.prev
	} else if p.tail == sl {
		p.tail = e.prev
	}
	e.prev, e.next = none, none
}
