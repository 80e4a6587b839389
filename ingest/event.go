package ingest

import (
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// wireEvent is what one event object said, before it becomes a
// messages.Event. Every field of every event type is here (one wire shape),
// because "type" may come last in the object.
type wireEvent struct {
	typ           messages.EventType
	typeName      string // as sent, for EventError
	request       string // "" until a valid id was read
	aborted       bool
	group         int
	start         int
	promptTokens  int
	computed      int
	total         int
	maxOffload    int
	hasMaxOffload bool
	err           error // the first problem; the event is rejected if set
}

// reject records the event's first problem; later ones add nothing.
func (d *decoder) reject(reason error, msg string) {
	d.rejectf(reason, func() string { return msg })
}

// rejectf is reject with a text msg builds: it is called only for the
// first DetailedEventErrors rejected events of the batch; past them the
// event gets its reason's prebuilt error, so a body of junk events costs no
// formatting (about 500 bytes each was). A closure that is only called stays
// on the stack: its captures are not boxed either.
func (d *decoder) rejectf(reason error, msg func() string) {
	switch {
	case d.ev.err != nil:
	case d.detailed():
		d.ev.err = fmt.Errorf("%w: %w: %s", ErrBadEvent, reason, msg())
	default:
		d.ev.err = terse(reason)
	}
}

// detailed reports whether the current event, if rejected, gets an
// EventError of its own: one of the batch's first DetailedEventErrors.
func (d *decoder) detailed() bool { return d.rejects < DetailedEventErrors }

// event reads one element of the events array into d.ev and returns the
// messages.Event it makes; d.ev.err is set if the event is rejected. The
// error result is for syntax errors only, which end the batch.
//
// Every known field that is present is checked, whatever the type uses, so
// that the rule for engine authors is simple: a malformed field (wrong JSON
// type, negative count, id outside uint32, bad hash) rejects the event.
func (d *decoder) event() (messages.Event, error) {
	d.ev = wireEvent{}
	d.ids, d.hashRaw, d.hashEnds = d.ids[:0], d.hashRaw[:0], d.hashEnds[:0]
	if c := d.peek(); c != '{' {
		d.rejectf(ErrWrongType, func() string { return "the event is a " + kind(c) + ", want an object" })
		return messages.Event{}, d.skip(inEvents)
	}
	for more := !d.open('}'); more; {
		k, err := d.key()
		if err != nil {
			return messages.Event{}, err
		}
		e := &d.ev
		switch string(k) {
		case "type":
			err = d.typeField()
		case "request":
			err = d.requestField()
		case "aborted":
			err = d.boolField("aborted", &e.aborted)
		case "group":
			if err = d.countField("group", &e.group); err == nil && e.group >= d.lim.MaxGroups {
				d.rejectf(ErrOutOfRange, func() string {
					return fmt.Sprintf("group = %d, limit is %d groups", e.group, d.lim.MaxGroups)
				})
			}
		case "start":
			err = d.countField("start", &e.start)
		case "prompt_tokens":
			err = d.countField("prompt_tokens", &e.promptTokens)
		case "max_offload_tokens":
			e.maxOffload = -1
			err = d.countField("max_offload_tokens", &e.maxOffload)
			e.hasMaxOffload = e.maxOffload >= 0
		case "computed":
			err = d.countField("computed", &e.computed)
		case "total":
			err = d.countField("total", &e.total)
		case "hashes":
			err = d.hashesField()
		case "ids":
			err = d.idsField()
		default:
			err = d.skip(inField) // unknown fields are ignored (forward compatibility)
		}
		if err != nil {
			return messages.Event{}, err
		}
		if more, err = d.next('}'); err != nil {
			return messages.Event{}, err
		}
	}
	return d.build(), nil
}

// idArenaMin and hashArenaMin are the block ids and hashes one arena
// allocation holds at least: a batch's events share a few.
const (
	idArenaMin   = 128
	hashArenaMin = 16
)

// room makes room in the arena for n more elements (a fresh arena of at
// least atLeast when it lacks it; the full one is left to whoever holds
// parts of it) and returns where they will start.
func room[T any](arena *[]T, n, atLeast int) int {
	if cap(*arena)-len(*arena) < n {
		*arena = make([]T, 0, max(atLeast, n))
	}
	return len(*arena)
}

// since is what was appended to the arena from start on, capped so that an
// append by a consumer copies.
func since[T any](arena []T, start int) []T { return arena[start:len(arena):len(arena)] }

// carve appends src to the arena and returns the appended part (room, since).
func carve[T any](arena *[]T, src []T, atLeast int) []T {
	start := room(arena, len(src), atLeast)
	*arena = append(*arena, src...)
	return since(*arena, start)
}

// build turns a checked d.ev into an Event, copying only the fields its type
// uses (messages.Event's doc comment lists them).
func (d *decoder) build() messages.Event {
	e := &d.ev
	switch {
	case e.err != nil:
		return messages.Event{}
	case e.typ == 0 && e.typeName == "":
		d.reject(ErrUnknownType, `missing "type"`)
		return messages.Event{}
	case e.typ == 0:
		d.rejectf(ErrUnknownType, func() string { return fmt.Sprintf("%q is not an event type", e.typeName) })
		return messages.Event{}
	case e.request == "":
		d.reject(ErrBadRequestID, `missing "request"`)
		return messages.Event{}
	}
	ev := messages.Event{Type: e.typ, Request: e.request}
	switch e.typ {
	case messages.EvAdded:
		ev.PromptTokens = e.promptTokens
		ev.MaxOffloadTokens = -1
		if e.hasMaxOffload {
			ev.MaxOffloadTokens = e.maxOffload
		}
	case messages.EvHashes:
		if e.start > math.MaxInt-len(d.hashEnds) {
			d.reject(ErrOutOfRange, "start + len(hashes) overflows")
			return messages.Event{}
		}
		ev.Start = e.start
		ev.Hashes = d.hashes()
	case messages.EvBlocks:
		if e.start > math.MaxInt-len(d.ids) {
			d.reject(ErrOutOfRange, "start + len(ids) overflows")
			return messages.Event{}
		}
		ev.Group, ev.Start = e.group, e.start
		if len(d.ids) > 0 {
			ev.IDs = carve(&d.idArena, d.ids, idArenaMin)
		}
	case messages.EvTokens:
		ev.Computed, ev.Total = e.computed, e.total
	case messages.EvFinished:
		ev.Aborted, ev.Computed, ev.Total = e.aborted, e.computed, e.total
	}
	return ev
}

// hashes returns the current event's hashes. They share one string (one
// allocation for all their bytes, which is immutable, so sharing is safe);
// the slice is a capped part of the call's hash arena (sched copies the
// hashes out, so it is short-lived, like block ids).
func (d *decoder) hashes() []messages.Hash {
	if len(d.hashEnds) == 0 {
		return nil
	}
	all := string(d.hashRaw)
	start := room(&d.hashArena, len(d.hashEnds), hashArenaMin)
	prev := 0
	for _, end := range d.hashEnds {
		d.hashArena = append(d.hashArena, messages.Hash(all[prev:end]))
		prev = end
	}
	return since(d.hashArena, start)
}

func (d *decoder) typeField() error {
	switch c := d.peek(); c {
	case 'n':
		return d.literal("null")
	case '"':
	default:
		d.rejectf(ErrWrongType, func() string { return `"type" is a ` + kind(c) + ", want a string" })
		return d.skip(inField)
	}
	raw, esc, err := d.str()
	if err != nil {
		return err
	}
	if esc {
		raw, _ = d.unescape(raw)
	}
	if d.ev.typ = messages.ParseEventType(raw); d.ev.typ != 0 {
		d.ev.typeName = d.ev.typ.String() // a constant: no allocation
	} else if d.detailed() { // past those, no EventError shows it: no copy
		d.ev.typeName = string(raw[:min(len(raw), maxTypeBytes)])
	}
	return nil
}

// requestField reads "request": 1..MaxRequestIDBytes bytes of valid UTF-8.
func (d *decoder) requestField() error {
	switch c := d.peek(); c {
	case 'n':
		d.ev.request = ""
		return d.literal("null")
	case '"':
	default:
		d.rejectf(ErrBadRequestID, func() string { return `"request" is a ` + kind(c) + ", want a string" })
		return d.skip(inField)
	}
	raw, esc, err := d.str()
	if err != nil {
		return err
	}
	valid := true
	if esc {
		raw, valid = d.unescape(raw)
	}
	d.ev.request = ""
	switch {
	case len(raw) == 0:
		d.reject(ErrBadRequestID, `"request" is empty`)
	case len(raw) > d.lim.MaxRequestIDBytes:
		d.rejectf(ErrBadRequestID, func() string {
			return fmt.Sprintf(`"request" is %d bytes, over %d`, len(raw), d.lim.MaxRequestIDBytes)
		})
	default:
		// An id met before passed these checks then (only valid ids are
		// interned): most events name a request of an earlier event, and
		// checking the UTF-8 of each was a few percent of a light node's CPU.
		slot := d.internSlot(raw) // one hash for the lookup and the caching
		if slot != nil && valid && *slot == string(raw) {
			d.ev.request = *slot
		} else if !valid || !utf8.Valid(raw) {
			d.reject(ErrBadRequestID, `"request" is not valid UTF-8`)
		} else {
			d.ev.request = intern(slot, raw)
		}
	}
	return nil
}

func (d *decoder) boolField(name string, dst *bool) error {
	switch c := d.peek(); c {
	case 't':
		*dst = true
		return d.literal("true")
	case 'f':
		*dst = false
		return d.literal("false")
	case 'n':
		return d.literal("null")
	default:
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("%q is a %s, want a bool", name, kind(c)) })
		return d.skip(inField)
	}
}

// countField reads a count, index or offset: an integer in [0, MaxInt].
// null leaves *dst unchanged (absent).
func (d *decoder) countField(name string, dst *int) error {
	c := d.peek()
	switch {
	case c == 'n':
		return d.literal("null")
	case c != '-' && (c < '0' || c > '9'):
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("%q is a %s, want an integer", name, kind(c)) })
		return d.skip(inField)
	}
	v, cls, err := d.number()
	switch {
	case err != nil:
		return err
	case cls == numFrac:
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("%q is not an integer", name) })
	case cls == numOverflow || v > math.MaxInt:
		d.rejectf(ErrOutOfRange, func() string { return fmt.Sprintf("%q is too large", name) })
	case v < 0:
		d.rejectf(ErrOutOfRange, func() string { return fmt.Sprintf("%q = %d is negative", name, v) })
	default:
		*dst = int(v)
	}
	return nil
}
