package hostpool

import (
	"fmt"
	"slices"

	"github.com/kvactors/kvactors/messages"
)

// PrepareStore makes room for the keys not yet present, sizes[i] bytes for
// keys[i] (sizes nil: every chunk is one page, the single-size pool). It is
// all-or-nothing: when room cannot be made it returns ErrNoRoom and changes
// nothing (at once for a new chunk the whole pool cannot hold, whatever its
// size: see Fits, or for more new chunks than its cap). Room comes from free
// slots and free pages first, then by evicting
// least recently used ready keys that are neither pinned nor among keys (an
// offered key is never evicted to make room for its siblings), in LRU order
// and only as many as needed. Room is bytes and a count: the chunks present
// after the store are at most the cap (SetMaxChunks), evicting for it alike.
// New keys start Pending.
//
// Duplicate keys in one offer are stored once and need room once (see
// dedupMax).
func (p *Pool) PrepareStore(keys []messages.Key, sizes []int64) (Prepared, error) {
	var out Prepared
	err := p.prepareStore(&out, keys, sizes, true)
	return out, err
}

// PrepareStoreInto is PrepareStore writing its outcome over out, whose
// Keys, Ends, Slots, Pending, Evicted and Victims backing arrays it reuses
// (a decision's caller keeps one Prepared as scratch: those slices are read
// before the next decision). Ext is new every time, since a store job keeps
// its room until it ends. On error out is empty.
func (p *Pool) PrepareStoreInto(out *Prepared, keys []messages.Key, sizes []int64) error {
	return p.prepareStore(out, keys, sizes, true)
}

// Reset empties out for another call, keeping its backing arrays except
// Ext's (see PrepareStoreInto).
func (out *Prepared) Reset() {
	*out = Prepared{Keys: out.Keys[:0], Extents: Extents{Ends: out.Ends[:0]}, Slots: out.Slots[:0],
		Pending: out.Pending[:0], Evicted: out.Evicted[:0], Victims: out.Victims[:0]}
}

// prepareStore is PrepareStoreInto; rooms says whether to report the new
// keys' Extents and Slots (a caller that locates its keys later, as a load
// from disk does, does not need them built under the pool's lock).
func (p *Pool) prepareStore(out *Prepared, keys []messages.Key, sizes []int64, rooms bool) error {
	out.Reset()
	if sizes != nil && len(sizes) != len(keys) {
		return fmt.Errorf("%w: %d sizes for %d keys", ErrBadSize, len(sizes), len(keys))
	}
	for i, s := range sizes {
		switch {
		case s <= 0:
			return fmt.Errorf("%w: key %x: %d bytes", ErrBadSize, string(keys[i]), s)
		case !p.Fits(s):
			// Never fits: "no room" before split cuts a size of any
			// magnitude into pages.
			return fmt.Errorf("%w: key %x: %d bytes, more than the pool can hold (%d pages of %d)", ErrNoRoom,
				string(keys[i]), s, len(p.pages), p.pageBytes)
		}
	}
	p.nextEpoch()
	// Mark offered keys that are present (they must not be evicted for their
	// siblings) and count what the new ones need, per slot class. No map
	// changes yet: "no room" must cost little, since an overloaded node
	// meets it on every event.
	needed := p.needed[:0]
	short := len(keys) <= dedupMax
	newKeys := 0
	fresh := p.fresh[:0] // the new keys' indexes: no second lookup to add them
	tags := p.tags[:0]
	for _, k := range keys {
		tags = append(tags, p.index.tag(k))
	}
	for _, t := range tags {
		p.sink += p.index.touch(t)
	}
	p.tags = tags
	for i, k := range keys {
		if r, ok := p.index.getTagged(k, tags[i], p.entries); ok {
			p.entries[r].mark = p.epoch
			if p.entries[r].state == Pending {
				out.Pending = append(out.Pending, k)
			}
			continue
		}
		if short && slices.Contains(keys[:i], k) || !short && p.seenBefore(k) {
			continue // a repeat of an absent key: one chunk for both
		}
		newKeys++
		fresh = append(fresh, int32(i))
		p.cut = p.split(p.sizeOf(sizes, i), p.cut[:0])
		for _, cs := range p.cut {
			c := p.classOf(cs)
			if c.mark != p.epoch {
				c.mark, c.need, c.avail2 = p.epoch, 0, c.avail
				needed = append(needed, c)
			}
			c.need++
		}
	}
	p.needed, p.fresh = needed, fresh[:0]
	if !short {
		p.clearSeen()
	}
	if newKeys == 0 {
		return nil
	}
	if newKeys > p.maxChunks {
		out.Reset()
		return fmt.Errorf("%w: %d chunks need room, the pool holds at most %d", ErrNoRoom, newKeys, p.maxChunks)
	}
	// overCap: the chunks present after the store, less the victims so far,
	// are more than the cap.
	overCap := func(victims int) bool { return p.index.n-victims+newKeys > p.maxChunks }
	freed := 0
	victims := p.victims[:0]
	for r := p.head; r != none && (!p.fits(needed, freed) || overCap(len(victims))); r = p.entries[r].next {
		e := &p.entries[r]
		if e.pins != 0 || e.mark == p.epoch {
			continue
		}
		victims = append(victims, r)
		for _, pc := range e.pieces {
			freed += p.planFree(pc)
		}
	}
	p.victims = victims[:0]
	if !p.fits(needed, freed) || overCap(len(victims)) {
		out.Reset()
		return fmt.Errorf("%w: %d chunks need room, %d free pages, %d of %d chunks held, %d evictable", ErrNoRoom,
			newKeys, len(p.freePages), p.index.n, p.maxChunks, len(victims))
	}
	out.Keys, out.Evicted = slices.Grow(out.Keys, newKeys), slices.Grow(out.Evicted, len(victims))
	if rooms {
		out.Ext = make([]Extent, 0, newKeys) // kept by the job (JobChunk.Room): never reused
		out.Ends, out.Slots = slices.Grow(out.Ends, newKeys), slices.Grow(out.Slots, newKeys)
	}
	for _, r := range victims {
		p.sink += p.index.touch(p.entries[r].tag) // see touch
	}
	for _, r := range victims {
		e := &p.entries[r]
		out.Evicted = append(out.Evicted, e.key)
		if p.keepVictims {
			v := Victim{Key: e.key, Sum: e.sum, Extents: make([]Extent, 0, len(e.pieces))}
			for _, pc := range e.pieces {
				v.Extents = append(v.Extents, p.extent(pc))
			}
			out.Victims = append(out.Victims, v)
		}
		p.unlink(r)
		p.remove(r)
	}
	for _, i := range fresh {
		k := keys[i]
		r := p.add(k, tags[i], p.sizeOf(sizes, int(i)))
		out.Keys = append(out.Keys, k)
		if !rooms {
			continue
		}
		for _, pc := range p.entries[r].pieces {
			out.Ext = append(out.Ext, p.extent(pc))
		}
		out.Ends = append(out.Ends, len(out.Ext))
		out.Slots = append(out.Slots, int32(r))
	}
	return nil
}

// seenBefore reports whether k, an absent key of a long offer, was offered
// before in this call, and notes it in p.seen.
func (p *Pool) seenBefore(k messages.Key) bool {
	if p.seen == nil {
		p.seen = map[messages.Key]struct{}{} // grows to the longest offer once
	}
	if _, ok := p.seen[k]; ok {
		return true
	}
	p.seen[k] = struct{}{}
	return false
}

// clearSeen empties p.seen after a long offer, or drops it when it holds
// more than seenMax keys.
func (p *Pool) clearSeen() {
	if len(p.seen) > seenMax {
		p.seen = nil
		return
	}
	clear(p.seen)
}

func (p *Pool) sizeOf(sizes []int64, i int) int64 {
	if sizes == nil {
		return p.pageBytes
	}
	return sizes[i]
}

// nextEpoch starts a new PrepareStore's marks.
func (p *Pool) nextEpoch() {
	p.epoch++
	if p.epoch != 0 {
		return
	}
	// wrapped: no mark may look current
	for i := range p.entries {
		p.entries[i].mark = 0
	}
	for i := range p.pages {
		p.pages[i].mark = 0
	}
	for _, c := range p.classes {
		c.mark = 0
	}
	p.epoch = 1
}

// planFree counts a victim's piece toward the plan and returns 1 when it
// empties its page: the page then serves any class, and its slots stop
// counting for its own.
func (p *Pool) planFree(pc piece) int {
	pg := &p.pages[pc.pg]
	if pg.mark != p.epoch {
		pg.mark, pg.victims = p.epoch, 0
	}
	pg.victims++
	c := p.classes[pg.class]
	if pg.victims == pg.used {
		if c.mark == p.epoch {
			c.avail2 -= int64(c.perPage) - 1 // the page's other free slots move with it
		}
		return 1
	}
	if c.mark == p.epoch {
		c.avail2++
	}
	return 0
}

// fits reports whether the needed slots fit in the planned free slots of
// their classes plus the free pages and the pages the plan empties.
func (p *Pool) fits(needed []*class, freed int) bool {
	pages := 0
	for _, c := range needed {
		if short := c.need - c.avail2; short > 0 {
			pages += int((short + int64(c.perPage) - 1) / int64(c.perPage))
		}
	}
	return pages <= len(p.freePages)+freed
}

// reserveMax bounds the entries reserve sizes the tables for at once
// (~5 MiB of slab): a big pool whose first chunk is small must not take
// memory for a million entries it may never hold; past it the tables grow
// by doubling.
const reserveMax = 1 << 16

// reserve sizes the entry slab, when it is full, for as many chunks of size
// bytes as the pool holds (at most reserveMax), and the index with it: a
// pool filling up grows them once instead of doubling its way there (each
// doubling copies the slab and rehashes the index, in PrepareStore's
// critical section).
func (p *Pool) reserve(size int64) {
	if len(p.entries) < cap(p.entries) {
		return
	}
	n := int(min(p.Capacity()/max(size, 1), reserveMax, int64(p.maxChunks)))
	if n <= 2*cap(p.entries) {
		return // append's doubling is as good
	}
	entries := make([]entry, len(p.entries), n)
	copy(entries, p.entries)
	p.entries = entries
	p.index.reserve(n)
}

// add stores key as a new pending entry of size bytes and returns it.
func (p *Pool) add(k messages.Key, tag uint32, size int64) ref {
	var r ref
	if n := len(p.freeRefs); n > 0 {
		r = p.freeRefs[n-1]
		p.freeRefs = p.freeRefs[:n-1]
	} else {
		p.reserve(size)
		r = ref(len(p.entries))
		p.entries = append(p.entries, entry{})
	}
	e := &p.entries[r]
	pieces := e.pieces[:0]
	p.cut = p.split(size, p.cut[:0])
	for _, cs := range p.cut {
		pieces = append(pieces, p.alloc(cs))
	}
	*e = entry{key: k, state: Pending, size: size, pieces: pieces, prev: none, next: none}
	e.tag = tag
	p.index.put(tag, r)
	p.pending++
	p.dataBytes += size
	return r
}
