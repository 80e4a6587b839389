package ingest

import (
	"fmt"

	"github.com/kvactors/kvactors/messages"
)

// unhex maps a lowercase hex digit to its value and every other byte to
// 0xff. The protocol sends hashes and keys as lowercase hex only.
var unhex = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = byte(c - '0')
	}
	for c := 'a'; c <= 'f'; c++ {
		t[c] = byte(c - 'a' + 10)
	}
	return t
}()

// appendHash decodes the lowercase hex hash src onto dst. ok is false (and
// dst unchanged) unless src is lowercase hex of even length 2..2*maxBytes.
func appendHash[S string | []byte](dst []byte, src S, maxBytes int) ([]byte, bool) {
	if len(src) < 2 || len(src)%2 != 0 || len(src) > 2*maxBytes {
		return dst, false
	}
	n := len(dst)
	for i := 0; i < len(src); i += 2 {
		hi, lo := unhex[src[i]], unhex[src[i+1]]
		if hi|lo > 0xf {
			return dst[:n], false
		}
		dst = append(dst, hi<<4|lo)
	}
	return dst, true
}

// openArray starts reading an array field: null means absent (ok false,
// nothing to read), a non-array is a wrong type (skipped, ok false).
func (d *decoder) openArray(name string) (ok bool, err error) {
	switch c := d.peek(); c {
	case 'n':
		return false, d.literal("null")
	case '[':
		return true, nil
	default:
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("%q is a %s, want an array", name, kind(c)) })
		return false, d.skip(inField)
	}
}

// hashesField reads "hashes" into d.hashRaw / d.hashEnds.
func (d *decoder) hashesField() error {
	d.hashRaw, d.hashEnds = d.hashRaw[:0], d.hashEnds[:0] // a repeated key replaces
	if ok, err := d.openArray("hashes"); !ok {
		return err
	}
	n := 0
	for more := !d.open(']'); more; n++ {
		if err := d.hash(n); err != nil {
			return err
		}
		var err error
		if more, err = d.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// hash reads element n of "hashes".
func (d *decoder) hash(n int) error {
	c := d.peek()
	if c != '"' {
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("hashes[%d] is a %s, want a hex string", n, kind(c)) })
		return d.skip(inElement)
	}
	raw, esc, err := d.str()
	if err != nil {
		return err
	}
	if d.ev.err != nil {
		return nil // rejected already: only the syntax still matters
	}
	if n >= d.lim.MaxIDs {
		d.rejectf(ErrTooLarge, func() string { return fmt.Sprintf("more than %d hashes", d.lim.MaxIDs) })
		return nil
	}
	if esc {
		raw, _ = d.unescape(raw) // legal JSON, if odd: "\u0061" is "a"
	}
	var ok bool
	if d.hashRaw, ok = appendHash(d.hashRaw, raw, d.lim.MaxHashBytes); !ok {
		d.rejectf(ErrBadHash, func() string {
			return fmt.Sprintf("hashes[%d] is not lowercase hex of even length 2..%d", n, 2*d.lim.MaxHashBytes)
		})
		return nil
	}
	d.hashEnds = append(d.hashEnds, len(d.hashRaw))
	return nil
}

// idsField reads "ids" into d.ids: each an integer in [0, 2^32).
func (d *decoder) idsField() error {
	d.ids = d.ids[:0] // a repeated key replaces
	if ok, err := d.openArray("ids"); !ok {
		return err
	}
	n := 0
	for more := !d.open(']'); more; n++ {
		if err := d.id(n); err != nil {
			return err
		}
		var err error
		if more, err = d.next(']'); err != nil {
			return err
		}
	}
	return nil
}

// id reads element n of "ids".
func (d *decoder) id(n int) error {
	c := d.peek()
	if c != '-' && (c < '0' || c > '9') {
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("ids[%d] is a %s, want an integer", n, kind(c)) })
		return d.skip(inElement)
	}
	v, cls, err := d.number()
	switch {
	case err != nil:
		return err
	case d.ev.err != nil:
	case n >= d.lim.MaxIDs:
		d.rejectf(ErrTooLarge, func() string { return fmt.Sprintf("more than %d ids", d.lim.MaxIDs) })
	case cls == numFrac:
		d.rejectf(ErrWrongType, func() string { return fmt.Sprintf("ids[%d] is not an integer", n) })
	case cls == numOverflow || v < 0 || v > MaxBlockID:
		d.rejectf(ErrOutOfRange, func() string { return fmt.Sprintf("ids[%d] is outside [0, 2^32)", n) })
	default:
		d.ids = append(d.ids, messages.BlockID(v))
	}
	return nil
}
