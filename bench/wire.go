package bench

import (
	"encoding/hex"
	"strconv"
)

// hashBytes is the size of one block hash: vLLM's default sha256-based
// prefix hash.
const hashBytes = 32

// batch is one encoded P.E.events body (PROTOCOL.md "EventBatch").
type batch struct {
	body   []byte
	events int32
	// applied is how many of the events the node counts in
	// kvactors_events_applied_total: all but "added", which spawns the
	// request actor instead of being applied to one.
	applied int32
}

// encoder appends one batch body as JSON directly, the way an engine's
// msgspec encoder would, so building a workload is cheap. Request ids are
// plain ASCII and need no escaping.
type encoder struct {
	buf     []byte
	events  int
	applied int
}

func (e *encoder) begin(epoch string, seq uint64) {
	e.buf = append(e.buf[:0], `{"epoch":"`...)
	e.buf = append(e.buf, epoch...)
	e.buf = append(e.buf, `","seq":`...)
	e.buf = strconv.AppendUint(e.buf, seq, 10)
	e.buf = append(e.buf, `,"events":[`...)
	e.events, e.applied = 0, 0
}

// finish closes the body and returns an exact-size copy of it.
func (e *encoder) finish() batch {
	e.buf = append(e.buf, ']', '}')
	return batch{body: append([]byte(nil), e.buf...), events: int32(e.events), applied: int32(e.applied)}
}

func (e *encoder) open(typ, request string) {
	if e.events > 0 {
		e.buf = append(e.buf, ',')
	}
	e.events++
	if typ != "added" {
		e.applied++
	}
	e.buf = append(e.buf, `{"type":"`...)
	e.buf = append(e.buf, typ...)
	e.buf = append(e.buf, `","request":"`...)
	e.buf = append(e.buf, request...)
	e.buf = append(e.buf, '"')
}

func (e *encoder) int(name string, v int) {
	e.buf = append(e.buf, ',', '"')
	e.buf = append(e.buf, name...)
	e.buf = append(e.buf, '"', ':')
	e.buf = strconv.AppendInt(e.buf, int64(v), 10)
}

func (e *encoder) added(req string, prompt int) {
	e.open("added", req)
	e.int("prompt_tokens", prompt)
	e.buf = append(e.buf, '}')
}

// hashes writes hashes [start, end) of a request; hash(i) fills one.
func (e *encoder) hashes(req string, start, end int, hash func(i int, dst *[hashBytes]byte)) {
	e.open("hashes", req)
	e.int("start", start)
	e.buf = append(e.buf, `,"hashes":[`...)
	var h [hashBytes]byte
	for i := start; i < end; i++ {
		if i > start {
			e.buf = append(e.buf, ',')
		}
		hash(i, &h)
		e.buf = append(e.buf, '"')
		e.buf = hex.AppendEncode(e.buf, h[:])
		e.buf = append(e.buf, '"')
	}
	e.buf = append(e.buf, ']', '}')
}

func (e *encoder) blocks(req string, group, start int, ids []uint32) {
	e.open("blocks", req)
	e.int("group", group)
	e.int("start", start)
	e.buf = append(e.buf, `,"ids":[`...)
	for i, id := range ids {
		if i > 0 {
			e.buf = append(e.buf, ',')
		}
		e.buf = strconv.AppendUint(e.buf, uint64(id), 10)
	}
	e.buf = append(e.buf, ']', '}')
}

func (e *encoder) tokens(req string, computed, total int) {
	e.open("tokens", req)
	e.int("computed", computed)
	e.int("total", total)
	e.buf = append(e.buf, '}')
}

func (e *encoder) finished(req string, aborted bool, computed, total int) {
	e.open("finished", req)
	e.buf = append(e.buf, `,"aborted":`...)
	e.buf = strconv.AppendBool(e.buf, aborted)
	e.int("computed", computed)
	e.int("total", total)
	e.buf = append(e.buf, '}')
}

// splitmix64 is a fast, well-mixed 64-bit hash for deterministic content.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// fillHash writes the 32-byte hash for (seed, i).
func fillHash(seed uint64, i int, dst *[hashBytes]byte) {
	x := splitmix64(seed ^ splitmix64(uint64(i)+1))
	for w := 0; w < hashBytes/8; w++ {
		x = splitmix64(x + uint64(w))
		for b := 0; b < 8; b++ {
			dst[w*8+b] = byte(x >> (8 * b))
		}
	}
}
