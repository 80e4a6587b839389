package hostpool

import (
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/messages"
)

// State of a key in the pool.
type State uint8

const (
	Absent  State = iota // not in the pool
	Pending              // a store copy is filling its slots; not loadable
	Ready                // stored and loadable
)

var stateNames = [...]string{"absent", "pending", "ready"}

func (s State) String() string { return stateNames[s] }

// Errors returned by the pool; check with errors.Is.
var (
	// ErrNoRoom means PrepareStore could not free enough room: every
	// evictable chunk is pending, pinned or among the offered keys. Nothing
	// changed; the caller retries later (PROTOCOL.md: "a retry").
	ErrNoRoom = errors.New("hostpool: no room")
	// ErrNotReady means a key asked for by a load is absent or pending.
	ErrNotReady = errors.New("hostpool: key not ready")
	// ErrPending is the ErrNotReady of a load whose every key is loadable
	// but for some pending in another copy (a store, or a read back from
	// a lower tier), which completes or frees them: the load may wait for
	// them (Shared.WaitPending, on the KeyError's key) and try again.
	// errors.Is(err, ErrNotReady) holds too.
	ErrPending = fmt.Errorf("%w: pending in another copy", ErrNotReady)
	// ErrBadSize means an offer's sizes do not match its keys or a size is
	// not positive; nothing changed.
	ErrBadSize = errors.New("hostpool: bad chunk size")
)

// Prepared is the outcome of a successful PrepareStore: Keys are to be copied
// in (keys already present, ready or pending, are left out). An empty Keys
// with a nil error is "nothing to store", distinct from ErrNoRoom.
type Prepared struct {
	Keys []messages.Key
	// Extents are the room given to Keys (Chunk(i) is Keys[i]'s), and Slots
	// their entries, when PrepareStore reports them. A store job copies into
	// that room and completes by those entries without locating its keys
	// again. That is sound because a pending entry is freed by its own job
	// only (completed or aborted; never evicted, never cancelled while
	// copying), so its room cannot change hands before the job ends.
	Extents
	Slots []int32
	// Pending are the offered keys left out because another copy is still
	// filling them, in offer order: that copy may yet fail or be cancelled
	// and free them, so the offerer must offer them again until they are
	// ready (PROTOCOL.md: a ready chunk is never skipped).
	Pending []messages.Key
	Evicted []messages.Key // ready keys evicted to make room, oldest first
	// Victims are the evicted chunks' checksums and extents, in Evicted's
	// order, when the pool keeps them (SetKeepVictims: a disk tier copies
	// them out). Their room is free once the lock is let go: it may be
	// Keys', or in a pool of mixed chunk sizes the next decision's (another
	// engine's), so a copy of a victim's bytes made after the decision must
	// check them against the victim's checksum (the disk tier does).
	Victims []Victim
	// RoomGen is how many times room may have freed before the decision
	// (Shared's room changes): a decision that found no room hands it to
	// WaitRoom, which wakes at once if room freed since.
	RoomGen uint64
}

// Extents are the extents of several chunks, flat: chunk i's are
// Ext[Ends[i-1]:Ends[i]].
type Extents struct {
	Ext  []Extent
	Ends []int
}

// Chunk is chunk i's extents.
func (x *Extents) Chunk(i int) []Extent {
	lo := 0
	if i > 0 {
		lo = x.Ends[i-1]
	}
	return x.Ext[lo:x.Ends[i]:x.Ends[i]]
}

// Victim is an evicted chunk: where its bytes were and their checksum.
type Victim struct {
	Key     messages.Key
	Sum     uint32
	Extents []Extent
}

// ref is an entry's index in the entry slab.
type ref int32

// none is the null entry link.
const none ref = -1

// entry is one chunk's bookkeeping.
type entry struct {
	key    messages.Key
	state  State
	pins   int32
	mark   uint32 // == Pool.epoch while offered in the running PrepareStore
	size   int64
	sum    uint32 // CRC-32C of the chunk's bytes, set when its store completes
	tag    uint32 // the key's index tag (keyIndex.put)
	pieces []piece
	// LRU links; only ready entries are linked.
	prev, next ref
}

// dedupMax: an offer of up to this many keys is checked for repeats of an
// absent key (a repeat needs no second chunk) by a scan of the keys before
// it, which allocates nothing; a longer one through the Pool's seen set,
// which a scan would make quadratic. A repeat is rare (two chunks with one
// last hash, which a chained-hash engine never sends) but must not be
// counted twice: that refuses an offer that fits, or evicts more than it
// needs. Offers are mostly short, and an overloaded node meets "no room" on
// every event, so the short path stays a scan.
const dedupMax = 32

// seenMax bounds the seen set kept between calls: a table that grew for a
// huge offer is dropped rather than cleared every later call (clearing a
// map costs its capacity, not its length).
const seenMax = 1 << 12

// DefaultPageBytes is the page size New uses for pageBytes <= 0.
const DefaultPageBytes = 1 << 20

// MaxPageBytes is the largest page New cuts: a page's slots are counted and
// indexed in int32, and a larger page cut into one-byte slots (a chunk's
// tail may be one) would have more than an int32 holds.
const MaxPageBytes = 1 << 30

// MaxPages is the most pages New cuts: pages are numbered in int32, and the
// page table costs about 64 bytes a page (1 GiB at this bound). A node's
// config refuses a pool that would need more (node.Config.Validate); New
// leaves the rest of a larger arena unused.
const MaxPages = 1 << 24

// MaxChunks is the most chunks a pool holds, whatever SetMaxChunks asks:
// entries are numbered in int32 (ref).
const MaxChunks = 1 << 30

// chunkBytesPerEntry is the pool bytes DefaultMaxChunks gives each chunk it
// counts: a chunk's bookkeeping is ~170 bytes of heap (its entry, key,
// pieces and index slot), so a pool of chunks no smaller keeps its heap
// within ~4% of its bytes. Real KV chunks are tens of KiB to MiBs.
const chunkBytesPerEntry = 4 << 10

// minDefaultMaxChunks is DefaultMaxChunks' floor: a small pool of small
// chunks (16 MiB of 256-byte ones: 64 Ki) is not capped below its bytes.
const minDefaultMaxChunks = 1 << 16

// DefaultMaxChunks is the chunk cap a node gives a pool of bytes: one
// chunk per 4 KiB, at least 65536, at most MaxChunks. Without a cap an
// engine whose spec chooses tiny chunks (one-byte blocks) fills the
// pool's bytes with as many entries, whose heap (~170 bytes each: 170 GB
// for a 1 GiB pool) is far past the pool's.
func DefaultMaxChunks(bytes int64) int {
	return int(min(max(bytes/chunkBytesPerEntry, minDefaultMaxChunks), MaxChunks))
}

// Pool tracks which chunk lives where in an arena of pages. The zero value is
// not usable; call New.
type Pool struct {
	pageBytes int64
	unit      int64 // pageBytes/16: the piece size of chunks that fit pages badly
	pages     []page
	freePages []int32
	classes   map[int64]*class
	entries   []entry
	freeRefs  []ref
	index     keyIndex
	// LRU list of ready entries: head is least recently used.
	head, tail  ref
	pending     int
	pinned      int
	maxChunks   int // the most entries present (SetMaxChunks)
	dataBytes   int64
	epoch       uint32
	keepVictims bool
	// scratch of PrepareStore
	victims []ref
	needed  []*class
	cut     []int64
	fresh   []int32
	tags    []uint32                  // prepareStore's keys' index tags
	sink    uint64                    // keeps keyIndex.touch's reads
	seen    map[messages.Key]struct{} // absent keys of a long offer (see dedupMax)
	// madeReady are the keys the last CompleteStoreAt made ready (for
	// Shared's journal; reused).
	madeReady []messages.Key
}

// New returns a pool over bytes of arena cut into pages of pageBytes
// (DefaultPageBytes when <= 0, MaxPageBytes when larger; a pool smaller
// than a page is one page). The tail past the last whole page, or past
// MaxPages, is not used.
func New(bytes, pageBytes int64) *Pool {
	if pageBytes <= 0 {
		pageBytes = DefaultPageBytes
	}
	pageBytes = min(pageBytes, MaxPageBytes)
	if bytes < 0 {
		bytes = 0
	}
	if bytes > 0 && bytes < pageBytes {
		pageBytes = bytes
	}
	n := min(bytes/pageBytes, MaxPages)
	p := &Pool{pageBytes: pageBytes, unit: max(pageBytes/16, 1), pages: make([]page, n),
		freePages: make([]int32, n), classes: map[int64]*class{}, index: newKeyIndex(0),
		head: none, tail: none, maxChunks: MaxChunks}
	for i := range p.pages {
		p.pages[i].pos = -1
		p.freePages[i] = int32(n) - 1 - int32(i) // page 0 is handed out first
	}
	return p
}

// SetMaxChunks bounds the chunks the pool holds, pending or ready, to n
// (n <= 0 or past MaxChunks: MaxChunks), as its pages bound their bytes:
// PrepareStore evicts for the count as it does for bytes, and HoldsEmpty
// counts it. Set it before the pool is used: HoldsEmpty reads it unlocked
// (Shared).
func (p *Pool) SetMaxChunks(n int) {
	if n <= 0 || n > MaxChunks {
		n = MaxChunks
	}
	p.maxChunks = n
}

// SetKeepVictims makes PrepareStore report evicted chunks' extents and
// checksums (Prepared.Victims).
func (p *Pool) SetKeepVictims(keep bool) { p.keepVictims = keep }

// PageBytes is the page size.
func (p *Pool) PageBytes() int64 { return p.pageBytes }

// Capacity is the bytes of the pool's pages.
func (p *Pool) Capacity() int64 { return int64(len(p.pages)) * p.pageBytes }

// Fits reports whether a chunk of size bytes can ever be stored: whether an
// empty pool holds it. Its bytes are not enough to tell: a chunk whose tail
// is cut into 1/16-page units and a smaller slot (alloc.go) needs a page for
// each, so one just under the capacity may need a page more than the pool
// has.
//
// A chunk takes at most two pages past its whole ones, so one that leaves
// two pages spare fits without the divisions (PrepareStore asks per new
// key).
func (p *Pool) Fits(size int64) bool {
	if spare := int64(len(p.pages)) - 2; spare > 0 && size <= spare*p.pageBytes {
		return true
	}
	return p.pagesFor(size) <= int64(len(p.pages))
}

// pagesFor is the pages an empty pool gives a chunk of size bytes: split's
// whole pages, then one page per class of its tail (the at most 15 units
// share one page).
func (p *Pool) pagesFor(size int64) int64 {
	n, r := size/p.pageBytes, size%p.pageBytes
	switch {
	case r <= 0:
	case (p.pageBytes%r)*16 <= p.pageBytes:
		n++
	default:
		if r >= p.unit {
			n++
		}
		if r%p.unit > 0 {
			n++
		}
	}
	return n
}

// HoldsEmpty reports whether an empty pool holds counts[i] chunks of
// sizes[i] bytes, for every i, together: their whole pages, then for each
// tail class the pages its slots fill (split). Bytes are not enough to tell
// (Fits): a set within the capacity whose tails' slots waste part of each
// page may need more pages than the pool has. Nor are they more chunks
// than its cap (SetMaxChunks). It reads only what New and SetMaxChunks set.
func (p *Pool) HoldsEmpty(sizes, counts []int64) bool {
	have := int64(len(p.pages))
	var pages, chunks int64
	// Each tail class's slots summed over every size with a piece of it
	// (sizes is a few groups: a linear search per piece is cheap; the
	// array keeps a handful of groups off the heap).
	var buf [8]tailPiece
	slots := buf[:0]
	for i, size := range sizes {
		if counts[i] <= 0 {
			continue
		}
		chunks += counts[i]
		pages += counts[i] * (size / p.pageBytes)
		for _, c := range p.tailClasses(size) {
			if c.class == 0 {
				continue
			}
			j := 0
			for j < len(slots) && slots[j].class != c.class {
				j++
			}
			if j == len(slots) {
				slots = append(slots, tailPiece{class: c.class})
			}
			slots[j].slots += counts[i] * c.slots
		}
	}
	for _, c := range slots {
		perPage := p.pageBytes / c.class
		pages += (c.slots + perPage - 1) / perPage
	}
	return pages <= have && chunks <= int64(p.maxChunks)
}

type tailPiece struct{ class, slots int64 }

// tailClasses is what split cuts a chunk of size bytes into past its whole
// pages: at most two classes, with their slots per chunk (class 0: none).
func (p *Pool) tailClasses(size int64) (t [2]tailPiece) {
	r := size % p.pageBytes
	switch {
	case r <= 0:
	case (p.pageBytes%r)*16 <= p.pageBytes:
		t[0] = tailPiece{r, 1}
	default:
		if r >= p.unit {
			t[0] = tailPiece{p.unit, r / p.unit}
		}
		if r%p.unit > 0 {
			t[1] = tailPiece{r % p.unit, 1}
		}
	}
	return t
}

// Len is the number of keys present, pending or ready.
func (p *Pool) Len() int { return p.index.n }

// full reports whether no key can be added: every chunk pending or pinned,
// and either the cap reached or no free page and no free slot.
func (p *Pool) full() bool {
	if p.index.n-p.pending-p.pinned > 0 {
		return false
	}
	if p.index.n >= p.maxChunks {
		return true
	}
	if len(p.freePages) > 0 {
		return false
	}
	for _, c := range p.classes {
		if c.avail > 0 {
			return false
		}
	}
	return true
}

// Stats is a point-in-time view of the pool.
type Stats struct {
	Capacity  int64 `json:"capacity_bytes"`
	Data      int64 `json:"data_bytes"` // bytes of stored and pending chunks
	PageBytes int64 `json:"page_bytes"`
	Pages     int   `json:"pages"`
	FreePages int   `json:"free_pages"`
	Used      int   `json:"chunks"`
	Pending   int   `json:"pending"`
	Ready     int   `json:"ready"`
	Pinned    int   `json:"pinned"`
	MaxChunks int   `json:"max_chunks"` // the most chunks held (SetMaxChunks)
}

// Stats reports usage.
func (p *Pool) Stats() Stats {
	used := p.index.n
	return Stats{Capacity: p.Capacity(), Data: p.dataBytes, PageBytes: p.pageBytes, Pages: len(p.pages),
		FreePages: len(p.freePages), Used: used, Pending: p.pending, Ready: used - p.pending, Pinned: p.pinned,
		MaxChunks: p.maxChunks}
}

// lookup is key's entry.
func (p *Pool) lookup(key messages.Key) (ref, bool) { return p.index.get(key, p.entries) }

// Lookup returns the state of key and its size in bytes (0 when Absent).
func (p *Pool) Lookup(key messages.Key) (State, int64) {
	r, ok := p.lookup(key)
	if !ok {
		return Absent, 0
	}
	return p.entries[r].state, p.entries[r].size
}

// locate appends the arena extents of a key, in chunk order, to dst and
// returns them with the chunk's checksum (valid once ready) and its state
// (Absent: nothing appended). Extents do not move while the key is pending
// or pinned.
func (p *Pool) locate(key messages.Key, dst []Extent) ([]Extent, uint32, State) {
	r, ok := p.lookup(key)
	if !ok {
		return dst, 0, Absent
	}
	e := &p.entries[r]
	for _, pc := range e.pieces {
		dst = append(dst, p.extent(pc))
	}
	return dst, e.sum, e.state
}

// CompleteStore ends the copies of keys. On success (sums non-nil, one per
// key: each chunk's CRC-32C) pending keys become ready, most recently used.
// On failure (sums nil) pending keys are removed and their room freed; ready
// keys are never affected by a failure (another job stored them).
func (p *Pool) CompleteStore(keys []messages.Key, sums []uint32) (ended int) {
	return p.CompleteStoreAt(keys, nil, sums)
}

// CompleteStoreAt is CompleteStore with each key's entry as PrepareStore
// reported it (Prepared.Slots; nil: look every key up). A slot that does
// not hold its key (it cannot, while the key is pending, but a caller may
// be wrong) is looked up instead.
//
// It returns how many keys it ended (made ready or freed): the room waiters
// a completion may wake.
func (p *Pool) CompleteStoreAt(keys []messages.Key, slots []int32, sums []uint32) (ended int) {
	p.madeReady = p.madeReady[:0]
	for i, k := range keys {
		r, found := none, false
		if i < len(slots) && slots[i] >= 0 && int(slots[i]) < len(p.entries) && p.entries[slots[i]].key == k {
			r, found = ref(slots[i]), true
		} else {
			r, found = p.lookup(k)
		}
		if !found || p.entries[r].state != Pending {
			continue
		}
		p.pending--
		ended++
		if sums != nil {
			e := &p.entries[r]
			e.state, e.sum = Ready, sums[i]
			p.pushBack(r)
			p.madeReady = append(p.madeReady, k)
			continue
		}
		p.remove(r)
	}
	return ended
}

// CompleteStorePinned completes pending keys as ready with their checksums,
// pinned and most recently used, in one step: a load that brought them back
// from disk copies them out next, and nothing may evict them in between.
func (p *Pool) CompleteStorePinned(keys []messages.Key, sums []uint32) {
	p.CompleteStore(keys, sums)
	for _, k := range keys {
		if r, ok := p.lookup(k); ok && p.entries[r].state == Ready {
			p.pin(r)
		}
	}
	p.Touch(keys)
}

// Drop removes a ready, unpinned key (a chunk found corrupt) whose
// checksum is still sum, and reports whether it did. A key pinned by another
// load is left to that load, which verifies it too. The checksum names the
// copy found corrupt: the finder unpinned it before dropping it, and in
// between it may have been evicted and stored again with good bytes.
func (p *Pool) Drop(key messages.Key, sum uint32) bool {
	r, ok := p.lookup(key)
	if !ok || p.entries[r].state != Ready || p.entries[r].pins > 0 || p.entries[r].sum != sum {
		return false
	}
	p.unlink(r)
	p.remove(r)
	return true
}

// remove frees an unlinked entry and its room.
func (p *Pool) remove(r ref) {
	e := &p.entries[r]
	for _, pc := range e.pieces {
		p.release(pc)
	}
	p.index.del(e.tag, r)
	p.dataBytes -= e.size
	e.key, e.pieces = "", e.pieces[:0]
	p.freeRefs = append(p.freeRefs, r)
}

// PrepareLoad pins every key so it cannot be evicted while its bytes are
// copied out. All keys must be ready; otherwise it pins nothing and returns
// an error naming the first key that is absent (ErrNotReady), or when none
// is, the first that is pending (ErrPending).
func (p *Pool) PrepareLoad(keys []messages.Key) error {
	var pending *KeyError
	for _, k := range keys {
		r, ok := p.lookup(k)
		switch {
		case !ok:
			return &KeyError{Key: k, Err: ErrNotReady}
		case p.entries[r].state != Ready && pending == nil:
			pending = &KeyError{Key: k, Err: ErrPending}
		}
	}
	if pending != nil {
		return pending
	}
	for _, k := range keys {
		r, _ := p.lookup(k)
		p.pin(r)
	}
	return nil
}

// pin takes one more pin on entry r: no eviction takes it until each pin
// is let go (CompleteLoad).
func (p *Pool) pin(r ref) {
	e := &p.entries[r]
	if e.pins == 0 {
		p.pinned++
	}
	e.pins++
}

// PinReady pins those of keys that are ready, each time it is given, and
// returns them (unpin them with CompleteLoad); it leaves the others as
// they are: absent, or pending in another copy (that copy's own to end).
func (p *Pool) PinReady(keys []messages.Key) []messages.Key {
	var pinned []messages.Key
	for _, k := range keys {
		if r, ok := p.lookup(k); ok && p.entries[r].state == Ready {
			p.pin(r)
			pinned = append(pinned, k)
		}
	}
	return pinned
}

// CompleteLoad unpins keys pinned by PrepareLoad, and returns how many of
// them it left unpinned (evictable again).
func (p *Pool) CompleteLoad(keys []messages.Key) (unpinned int) {
	for _, k := range keys {
		if r, ok := p.lookup(k); ok && p.entries[r].pins > 0 {
			e := &p.entries[r]
			e.pins--
			if e.pins == 0 {
				p.pinned--
				unpinned++
			}
		}
	}
	return unpinned
}

// Touch marks ready keys as most recently used. Like vLLM it walks them in
// reverse, so the first key of a prefix ends up the most recent and a prefix
// is evicted from its tail first.
func (p *Pool) Touch(keys []messages.Key) {
	for i := len(keys) - 1; i >= 0; i-- {
		if r, ok := p.lookup(keys[i]); ok && p.entries[r].state == Ready {
			p.unlink(r)
			p.pushBack(r)
		}
	}
}

// KeyError names the key an operation failed on.
type KeyError struct {
	Key messages.Key // as the pool keys it: what the pool's methods take
	// Shown, when set, is the key as Error names it: the form the caller's
	// users know, where the pool key adds the caller's own qualifier (the
	// node's keys start with a namespace number of its boot, which no
	// engine knows).
	Shown messages.Key
	Err   error
}

func (e *KeyError) Error() string {
	k := e.Key
	if e.Shown != "" {
		k = e.Shown
	}
	return fmt.Sprintf("key %x: %v", string(k), e.Err)
}
func (e *KeyError) Unwrap() error { return e.Err }

func (p *Pool) pushBack(r ref) {
	e := &p.entries[r]
	e.prev, e.next = p.tail, none
	if p.tail != none {
		p.entries[p.tail].next = r
	} else {
		p.head = r
	}
	p.tail = r
}

func (p *Pool) unlink(r ref) {
	e := &p.entries[r]
	if e.prev != none {
		p.entries[e.prev].next = e.next
	} else if p.head == r {
		p.head = e.next
	}
	if e.next != none {
		p.entries[e.next].prev = e.prev
	} else if p.tail == r {
		p.tail = e.prev
	}
	e.prev, e.next = none, none
}
