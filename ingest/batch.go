package ingest

import (
	"bytes"
	"fmt"
	"hash/maphash"
	"sync"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// DecodeBatch decodes the body of P.E.events for engine (the id from the
// subject, copied into the batch). It returns an error wrapping ErrMalformed,
// and no batch, if the body is not valid JSON, is not an object, lacks a
// non-empty epoch string of at most 256 bytes, a non-negative integer seq or
// an events array, or holds more than lim.MaxEvents events. Otherwise every
// well-formed event is in the batch, in order, and each rejected event is
// reported once in the []EventError (PROTOCOL.md "EventBatch"): the first
// DetailedEventErrors of them each in its own, in order, with Count 1; the
// others, if any, in one summary per reason after those (its Count the
// number of events, its Err naming no event), so that the Counts sum to the
// number of rejected events, by reason. Zero fields of lim mean their
// defaults.
func DecodeBatch(engine string, data []byte, lim Limits) (messages.EventBatch, []EventError, error) {
	return DecodeBatchInto(engine, data, lim, nil)
}

// DecodeBatchInto is DecodeBatch appending the events to evs[:0] (a slice
// being reused: the node recycles its batches' event slices); it grows as
// append does when evs is short.
func DecodeBatchInto(engine string, data []byte, lim Limits, evs []messages.Event) (messages.EventBatch, []EventError, error) {
	sc := scratchPool.Get().(*scratch)
	b, bad, err := decodeWith(sc, engine, data, lim, evs)
	if sc.fits() {
		scratchPool.Put(sc)
	}
	return b, bad, err
}

// decodeWith is DecodeBatchInto with sc as its scratch, which it leaves
// holding its grown slices and interned ids for the next batch.
func decodeWith(sc *scratch, engine string, data []byte, lim Limits, evs []messages.Event) (messages.EventBatch, []EventError, error) {
	d := decoder{lexer: lexer{data: data}, lim: lim.WithDefaults()}
	d.ids, d.hashRaw, d.hashEnds = sc.ids[:0], sc.hashRaw[:0], sc.hashEnds[:0]
	d.interned = &sc.interned
	defer sc.keep(&d)
	b := messages.EventBatch{Engine: engine, Events: evs[:0]}
	var (
		bad                         []EventError
		hasEpoch, hasSeq, hasEvents bool
	)
	if d.peek() != '{' {
		return messages.EventBatch{}, nil, d.envelope("the body is not a JSON object")
	}
	for more := !d.open('}'); more; {
		k, err := d.key()
		if err != nil {
			return messages.EventBatch{}, nil, err
		}
		switch string(k) {
		case "epoch":
			b.Epoch, hasEpoch, err = d.epoch()
		case "seq":
			b.Seq, hasSeq, err = d.seq()
		case "events":
			// A repeated key replaces the earlier value, as in encoding/json.
			b.Events, bad, hasEvents, err = d.events(b.Events[:0], bad[:0])
		default:
			err = d.skip(inEnvelope)
		}
		if err != nil {
			return messages.EventBatch{}, nil, err
		}
		if more, err = d.next('}'); err != nil {
			return messages.EventBatch{}, nil, err
		}
	}
	if err := d.end(); err != nil {
		return messages.EventBatch{}, nil, err
	}
	switch {
	case !hasEpoch:
		return messages.EventBatch{}, nil, d.envelope(`missing "epoch"`)
	case !hasSeq:
		return messages.EventBatch{}, nil, d.envelope(`missing "seq"`)
	case !hasEvents:
		return messages.EventBatch{}, nil, d.envelope(`missing "events"`)
	}
	return b, bad, nil
}

var openBrace = []byte{'{'}

// minEventBytes is the length of the shortest event DecodeBatch accepts: it
// needs a "type" (no name is shorter than "added") and a non-empty "request".
const minEventBytes = len(`{"type":"added","request":"r"}`)

// scratch is a decoder's per-event working memory, pooled across batches:
// growing it afresh for every batch was about a sixth of the decoder's
// allocations. Accepted events get their own copies (build), so nothing
// returned aliases it.
type scratch struct {
	ids      []messages.BlockID
	hashRaw  []byte
	hashEnds []int
	// interned are recent request ids, by a hash of their bytes: a request's
	// events span several batches, and each batch allocated its ids afresh
	// (a sixth of the node's allocations, counted). The scratch is pooled per
	// P, so this outlives the batch; strings are immutable, so sharing one
	// between batches or engines is safe.
	interned [internSlots]string
}

// internSlots is the size of the cross-batch intern cache, 64 KiB of
// string headers. With 256 slots, an engine's requests in flight across
// a prefill (hundreds to thousands at a time) pushed one another out, and
// most ids were allocated again in a later batch.
const internSlots = 4096

var internSeed = maphash.MakeSeed()

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

// scratchMax bounds the bytes a pooled scratch keeps: a batch of huge
// events does not pin its buffers.
const scratchMax = 64 << 10

// keep takes the decoder's grown buffers back.
func (sc *scratch) keep(d *decoder) {
	sc.ids, sc.hashRaw, sc.hashEnds = d.ids[:0], d.hashRaw[:0], d.hashEnds[:0]
}

// fits reports whether sc is small enough to pool.
func (sc *scratch) fits() bool {
	return cap(sc.ids)*4+cap(sc.hashRaw)+cap(sc.hashEnds)*8 <= scratchMax
}

// decoder holds the state of one DecodeBatch call. Its scratch slices are
// reused from event to event; an accepted event gets copies nothing reuses:
// its hash bytes a string of its own, its hash and block id slices capped
// parts of this call's arenas (a consumer that keeps a slice pins at most
// its arena: 512 bytes of ids, 16 hashes, or one event's).
type decoder struct {
	lexer
	lim      Limits
	ids      []messages.BlockID   // block ids of the current event
	hashRaw  []byte               // decoded bytes of the current event's hashes
	hashEnds []int                // end offset in hashRaw of each hash
	interned *[internSlots]string // the scratch's cross-batch cache (nil: none)
	// idArena backs the accepted events' block ids, one allocation for many
	// events (sched copies ids out, so an event's own slice is short-lived).
	idArena []messages.BlockID
	// hashArena backs the accepted events' hash slices the same way (each
	// event's hash bytes are still a string of its own: a request keeps its
	// hashes, and must not pin its batch's).
	hashArena []messages.Hash
	ev        wireEvent
	// rejects counts the events array's rejected events so far: the first
	// DetailedEventErrors get messages (detailed).
	rejects int
}

func (d *decoder) envelope(msg string) error {
	return fmt.Errorf("%w: event batch: %s", ErrMalformed, msg)
}

// epoch reads the "epoch" value: a non-empty UTF-8 string of at most
// MaxEpochBytes. null counts as absent, as in encoding/json.
func (d *decoder) epoch() (string, bool, error) {
	switch c := d.peek(); c {
	case 'n':
		return "", false, d.literal("null")
	case '"':
	default:
		return "", false, d.envelope(`"epoch" is a ` + kind(c) + ", want a string")
	}
	raw, esc, err := d.str()
	if err != nil {
		return "", false, err
	}
	valid := true
	if esc {
		raw, valid = d.unescape(raw)
	}
	switch {
	case len(raw) == 0:
		return "", false, d.envelope(`"epoch" is empty`)
	case len(raw) > MaxEpochBytes:
		return "", false, d.envelope(fmt.Sprintf(`"epoch" is %d bytes, over %d`, len(raw), MaxEpochBytes))
	case !valid || !utf8.Valid(raw):
		return "", false, d.envelope(`"epoch" is not valid UTF-8`)
	}
	return string(raw), true, nil
}

// seq reads the "seq" value: an integer in [0, 2^63) without a minus sign,
// not even "-0": seq is a uint64, which encoding/json (the heartbeat's
// decoder) refuses "-0" for. null counts as absent.
func (d *decoder) seq() (uint64, bool, error) {
	c := d.peek()
	switch {
	case c == 'n':
		return 0, false, d.literal("null")
	case c == '-' || ('0' <= c && c <= '9'):
	default:
		return 0, false, d.envelope(`"seq" is a ` + kind(c) + ", want an integer")
	}
	v, cls, err := d.number()
	switch {
	case err != nil:
		return 0, false, err
	case cls != numInt || v < 0 || c == '-':
		return 0, false, d.envelope(`"seq" is not an integer in [0, 2^63)`)
	}
	return uint64(v), true, nil
}

// events reads the "events" array, appending good events to evs and
// rejections to bad.
func (d *decoder) events(evs []messages.Event, bad []EventError) ([]messages.Event, []EventError, bool, error) {
	switch c := d.peek(); c {
	case 'n':
		return evs, bad, false, d.literal("null")
	case '[':
	default:
		return evs, bad, false, d.envelope(`"events" is a ` + kind(c) + ", want an array")
	}
	// Every event is an object, so counting '{' bounds the events from
	// above for the usual body (a vectorised byte count, far cheaper than
	// regrowing). Braces elsewhere (in strings, skipped fields, rejected
	// events) would reserve an Event (120 bytes) per byte of a hostile body,
	// so the guess is also bounded by the most accepted events the body can
	// hold. A slice being reused (the node's) grew to its batches' size
	// already: no count.
	if cap(evs) == 0 {
		evs = make([]messages.Event, 0, min(bytes.Count(d.data, openBrace), len(d.data)/minEventBytes, d.lim.MaxEvents))
	}
	i := 0
	d.rejects = 0
	for more := !d.open(']'); more; i++ {
		if i >= d.lim.MaxEvents {
			return evs, bad, false, fmt.Errorf("%w: %w: more than %d events in one batch", ErrMalformed, ErrTooLarge, d.lim.MaxEvents)
		}
		ev, err := d.event()
		if err != nil {
			return evs, bad, false, err
		}
		if d.ev.err != nil {
			bad = d.rejected(bad, i)
		} else {
			evs = append(evs, ev)
		}
		if more, err = d.next(']'); err != nil {
			return evs, bad, false, err
		}
	}
	return evs, bad, true, nil
}

// rejected reports event i, which d.ev holds rejected: in an EventError of
// its own if it is one of the first DetailedEventErrors, else in the summary
// of its reason (its Err: terse), appended after those on the reason's first
// event; a batch has a summary per reason at most, so the search is short.
func (d *decoder) rejected(bad []EventError, i int) []EventError {
	detailed := d.detailed()
	d.rejects++
	if detailed {
		return append(bad, EventError{Index: i, Type: d.ev.typeName, Request: d.ev.request, Err: d.ev.err, Count: 1})
	}
	for j := DetailedEventErrors; j < len(bad); j++ {
		if bad[j].Err == d.ev.err {
			bad[j].Count++
			return bad
		}
	}
	return append(bad, EventError{Index: i, Err: d.ev.err, Count: 1})
}

// intern returns raw as a string, sharing the allocation with an equal
// request id met before: a batch usually carries several events (hashes,
// blocks, tokens) for each of a few requests, and a request's events span
// several batches (the scratch's cache outlives the batch). slot is raw's
// place in the cache (internSlot; nil: no cache, as in tests, and every id
// is allocated). requestField interns only ids that passed its checks, so
// an id found in its slot needs none again.
func intern(slot *string, raw []byte) string {
	if slot == nil {
		return string(raw)
	}
	if *slot != string(raw) {
		*slot = string(raw)
	}
	return *slot
}

// internSlot is where an id equal to raw is cached (nil: no cache).
func (d *decoder) internSlot(raw []byte) *string {
	if d.interned == nil {
		return nil
	}
	return &d.interned[maphash.Bytes(internSeed, raw)%internSlots]
}
