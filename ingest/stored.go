package ingest

import (
	"fmt"
	"unicode/utf8"

	"github.com/kvactors/kvactors/messages"
)

// DecodeStored decodes the body of P.E.stored (node → engine, one per store
// job) with the hand-written reader: an engine gets one per job, and
// encoding/json spent about 15 µs of the engine's CPU on each, reflection
// and all (measured with the bench's client side, docs/BENCHMARKS.md).
//
// What it accepts is a subset of what json.Unmarshal into messages.Stored
// accepts, and for that subset the values are the same but for repeated
// keys:
//
//   - keys match exactly (encoding/json also matches other letter cases);
//   - a wrong JSON type anywhere, a fraction, a number outside its field's
//     type ("job" within [0, 2^63) and without a minus sign, even "-0";
//     "bytes" within int64; "group" and "index" within int), a null chunk,
//     or a string that is not valid UTF-8 (a lone surrogate escape
//     included) rejects the body, where encoding/json would report some of
//     these but still fill the rest;
//   - unknown fields are skipped; absent or null fields are zero;
//   - of repeated keys the last wins whole: a repeated "chunks" replaces
//     the earlier list, where encoding/json decodes it into the earlier
//     elements, merging their fields. The node never repeats a key.
//
// Errors wrap ErrMalformed.
func DecodeStored(data []byte) (messages.Stored, error) {
	d := storedDecoder{lexer: lexer{data: data}}
	st, err := d.stored()
	if err != nil {
		return messages.Stored{}, fmt.Errorf("stored: %w", err)
	}
	return st, nil
}

type storedDecoder struct{ lexer }

func (d *storedDecoder) wrong(field, want string) error {
	return fmt.Errorf("%w: %q is a %s, want %s", ErrMalformed, field, kind(d.peek()), want)
}

func (d *storedDecoder) stored() (st messages.Stored, err error) {
	if d.peek() != '{' {
		return st, fmt.Errorf("%w: the body is a %s, want an object", ErrMalformed, kind(d.peek()))
	}
	err = d.members(func(k []byte) (err error) {
		switch string(k) {
		case "request":
			st.Request, err = d.text("request")
		case "job":
			var v int64
			v, err = d.integer("job", 0, maxInt64)
			st.Job = uint64(v)
		case "bytes":
			st.Bytes, err = d.integer("bytes", minInt64, maxInt64)
		case "chunks":
			st.Chunks, err = d.chunks(st.Chunks[:0])
		default:
			err = d.skip(inEnvelope)
		}
		return err
	})
	if err != nil {
		return st, err
	}
	return st, d.end()
}

// members reads the object the caller peeked, calling member for each key
// with the reader at its value.
func (d *storedDecoder) members(member func(key []byte) error) error {
	for more := !d.open('}'); more; {
		k, err := d.key()
		if err != nil {
			return err
		}
		if err := member(k); err != nil {
			return err
		}
		if more, err = d.next('}'); err != nil {
			return err
		}
	}
	return nil
}

func (d *storedDecoder) chunks(out []messages.StoredChunk) ([]messages.StoredChunk, error) {
	switch d.peek() {
	case 'n':
		return nil, d.literal("null")
	case '[':
	default:
		return nil, d.wrong("chunks", "an array")
	}
	if d.open(']') {
		return []messages.StoredChunk{}, nil // as encoding/json: empty, not nil
	}
	for more := true; more; {
		if d.peek() != '{' {
			return nil, d.wrong("chunks[]", "an object")
		}
		var ch messages.StoredChunk
		err := d.members(func(k []byte) (err error) {
			var v int64
			switch string(k) {
			case "group":
				v, err = d.integer("group", minInt, maxInt)
				ch.Group = int(v)
			case "index":
				v, err = d.integer("index", minInt, maxInt)
				ch.Index = int(v)
			case "key":
				ch.Key, err = d.text("key")
			default:
				err = d.skip(inElement)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
		out = append(out, ch)
		if more, err = d.next(']'); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// text reads a string field (null is ""), unescaped and valid UTF-8.
func (d *storedDecoder) text(field string) (string, error) {
	switch d.peek() {
	case 'n':
		return "", d.literal("null")
	case '"':
	default:
		return "", d.wrong(field, "a string")
	}
	raw, esc, err := d.str()
	if err != nil {
		return "", err
	}
	valid := true
	if esc {
		raw, valid = d.unescape(raw)
	}
	if !valid || !utf8.Valid(raw) {
		return "", fmt.Errorf("%w: %q is not valid UTF-8", ErrMalformed, field)
	}
	return string(raw), nil
}

// integer reads an integer field in [lo, hi] (null is 0). With lo 0 the
// field is unsigned and a minus sign is refused, "-0" too, as encoding/json
// refuses it for a uint.
func (d *storedDecoder) integer(field string, lo, hi int64) (int64, error) {
	c := d.peek()
	switch {
	case c == 'n':
		return 0, d.literal("null")
	case c == '-' && lo == 0:
		return 0, fmt.Errorf("%w: %w: %q is negative", ErrMalformed, ErrOutOfRange, field)
	case c != '-' && (c < '0' || c > '9'):
		return 0, d.wrong(field, "an integer")
	}
	v, cls, err := d.number()
	switch {
	case err != nil:
		return 0, err
	case cls == numFrac:
		return 0, fmt.Errorf("%w: %q is not an integer", ErrMalformed, field)
	case cls == numOverflow || v < lo || v > hi:
		return 0, fmt.Errorf("%w: %w: %q is outside [%d, %d]", ErrMalformed, ErrOutOfRange, field, lo, hi)
	}
	return v, nil
}

const (
	maxInt64 = 1<<63 - 1
	minInt64 = -1 << 63
	maxInt   = int64(^uint(0) >> 1)
	minInt   = -maxInt - 1
)
