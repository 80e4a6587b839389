package hostpool

// The allocator: the arena is cut into equal pages; a page with a class
// holds slots of exactly that many bytes; a chunk is one or more slots
// (pieces), laid end to end in chunk order. Chunks of every size share the
// pages, so no size is fixed by the first engine.
//
// A chunk of s bytes is cut (split) as: s/P whole pages (class P), then the
// rest r = s mod P as one slot of class r if a page of r-slots wastes at most
// P/16, else as r/U slots of class U = P/16 plus one slot of class r mod U.
// So a full page wastes less than 1/16 of itself whatever the sizes, and a
// chunk needs at most s/P + 17 pieces.

// piece is one slot of a chunk: slot idx of page pg.
type piece struct{ pg, idx int32 }

// Extent is one piece of a chunk in the arena: Len bytes at Off.
type Extent struct{ Off, Len int64 }

type page struct {
	class int64 // slot bytes; 0: the page is free
	used  int32 // occupied slots
	fresh int32 // slots [fresh, perPage) never handed out since the page got its class
	free  []int32
	pos   int32 // index in its class's partial list; -1 when not there
	// planning scratch, valid while mark == Pool.epoch
	mark    uint32
	victims int32
}

type class struct {
	size    int64
	perPage int32
	avail   int64   // free slots over all its pages
	partial []int32 // pages with a free slot
	// planning scratch, valid while mark == Pool.epoch
	mark   uint32
	need   int64
	avail2 int64 // avail as the plan stands
}

// split appends the piece classes of a chunk of size bytes.
func (p *Pool) split(size int64, dst []int64) []int64 {
	for ; size >= p.pageBytes; size -= p.pageBytes {
		dst = append(dst, p.pageBytes)
	}
	if size == 0 {
		return dst
	}
	if (p.pageBytes%size)*16 <= p.pageBytes {
		return append(dst, size)
	}
	for ; size >= p.unit; size -= p.unit {
		dst = append(dst, p.unit)
	}
	if size > 0 {
		dst = append(dst, size)
	}
	return dst
}

func (p *Pool) classOf(size int64) *class {
	c, ok := p.classes[size]
	if !ok {
		c = &class{size: size, perPage: int32(p.pageBytes / size)}
		p.classes[size] = c
	}
	return c
}

// alloc takes a slot of class size: from a page of that class with room,
// else from a free page. The caller has checked there is room (plan).
func (p *Pool) alloc(size int64) piece {
	c := p.classOf(size)
	if len(c.partial) == 0 {
		n := len(p.freePages)
		pg := p.freePages[n-1]
		p.freePages = p.freePages[:n-1]
		p.pages[pg] = page{class: size, pos: -1, free: p.pages[pg].free[:0]}
		c.avail += int64(c.perPage)
		p.addPartial(c, pg)
	}
	pgi := c.partial[len(c.partial)-1]
	pg := &p.pages[pgi]
	var idx int32
	if n := len(pg.free); n > 0 {
		idx = pg.free[n-1]
		pg.free = pg.free[:n-1]
	} else {
		idx = pg.fresh
		pg.fresh++
	}
	pg.used++
	c.avail--
	if pg.used == c.perPage {
		p.dropPartial(c, pgi)
	}
	return piece{pgi, idx}
}

// release frees a slot; a page left empty goes back to the free pages.
func (p *Pool) release(pc piece) {
	pg := &p.pages[pc.pg]
	c := p.classes[pg.class]
	pg.used--
	c.avail++
	if pg.used == 0 {
		if pg.pos >= 0 {
			p.dropPartial(c, pc.pg)
		}
		c.avail -= int64(c.perPage)
		pg.class, pg.fresh, pg.free = 0, 0, pg.free[:0]
		p.freePages = append(p.freePages, pc.pg)
		return
	}
	pg.free = append(pg.free, pc.idx)
	if pg.pos < 0 {
		p.addPartial(c, pc.pg)
	}
}

func (p *Pool) addPartial(c *class, pg int32) {
	p.pages[pg].pos = int32(len(c.partial))
	c.partial = append(c.partial, pg)
}

func (p *Pool) dropPartial(c *class, pg int32) {
	i := p.pages[pg].pos
	last := c.partial[len(c.partial)-1]
	c.partial[i] = last
	p.pages[last].pos = i
	c.partial = c.partial[:len(c.partial)-1]
	p.pages[pg].pos = -1
}

// extent is where piece pc lies in the arena.
func (p *Pool) extent(pc piece) Extent {
	size := p.pages[pc.pg].class
	return Extent{Off: int64(pc.pg)*p.pageBytes + int64(pc.idx)*size, Len: size}
}
