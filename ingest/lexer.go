package ingest

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth bounds the nesting of objects and arrays, as encoding/json does
// (the same limit, so both agree on what is valid), so that a deeply nested
// unknown field cannot exhaust the stack.
const maxDepth = 10000

// How many objects and arrays enclose a value that the batch decoder skips;
// skip counts on from there.
const (
	inEnvelope = 1 // a member of the batch object
	inEvents   = 2 // an element of "events"
	inField    = 3 // a member of an event
	inElement  = 4 // an element of an event's array
)

// lexer is a minimal pull reader over one JSON document. It validates RFC 8259
// syntax as it goes, but leaves typing to its caller, so that a wrong type
// inside one event can be recorded and skipped instead of failing the batch.
// Every method first skips white space. Methods return an error only for a
// syntax error; such errors wrap ErrMalformed and end the decode.
type lexer struct {
	data []byte
	pos  int
	buf  []byte // scratch for unescaped strings; valid until the next unescape
}

func (l *lexer) syntax(msg string) error {
	return fmt.Errorf("%w: invalid JSON at offset %d: %s", ErrMalformed, l.pos, msg)
}

// peek skips white space and returns the next byte, or 0 at the end.
func (l *lexer) peek() byte {
	for l.pos < len(l.data) {
		switch c := l.data[l.pos]; c {
		case ' ', '\t', '\n', '\r':
			l.pos++
		default:
			return c
		}
	}
	return 0
}

// end reports an error unless only white space is left.
func (l *lexer) end() error {
	if l.peek() != 0 || l.pos < len(l.data) {
		return l.syntax("data after the top-level value")
	}
	return nil
}

// open consumes the '{' or '[' that the caller peeked and reports whether the
// container is empty (its closing byte consumed too).
func (l *lexer) open(closing byte) bool {
	l.pos++
	if l.peek() == closing {
		l.pos++
		return true
	}
	return false
}

// next consumes the ',' or closing byte after a member or element and
// reports whether another one follows.
func (l *lexer) next(closing byte) (bool, error) {
	switch l.peek() {
	case ',':
		l.pos++
		return true, nil
	case closing:
		l.pos++
		return false, nil
	}
	return false, l.syntax("expected ',' or '" + string(closing) + "'")
}

// key reads an object member name and the ':' after it. The result may alias
// l.buf: compare it before reading the value.
func (l *lexer) key() ([]byte, error) {
	if l.peek() != '"' {
		return nil, l.syntax("expected a string key")
	}
	raw, esc, err := l.str()
	if err != nil {
		return nil, err
	}
	if esc {
		raw, _ = l.unescape(raw)
	}
	if l.peek() != ':' {
		return nil, l.syntax("expected ':'")
	}
	l.pos++
	return raw, nil
}

// str reads the string that starts at l.pos (the caller peeked '"') and
// returns its raw bytes between the quotes (aliasing l.data) and whether it
// holds escapes. It checks escapes and rejects control characters, but not
// UTF-8 validity: callers that need it check the result.
func (l *lexer) str() (raw []byte, esc bool, err error) {
	start := l.pos + 1
	d := l.data
	for i := start; i < len(d); {
		// Eight bytes at a time while none needs attention: hashes and ids
		// are most of a batch's bytes, and a table lookup per byte was a
		// fifth of decoding.
		if i+8 <= len(d) {
			m := specials(binary.LittleEndian.Uint64(d[i:]))
			if m == 0 {
				i += 8
				continue
			}
			i += bits.TrailingZeros64(m) >> 3 // the first byte that needs attention
		} else if plain[d[i]] {
			i++ // within the data's last eight bytes
			continue
		}
		switch c := d[i]; {
		case c == '"':
			l.pos = i + 1
			return d[start:i], esc, nil
		case c == '\\':
			esc = true
			if i+1 >= len(d) {
				l.pos = i
				return nil, false, l.syntax("unterminated escape")
			}
			switch d[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(d) || hex4(d[i+2:i+6]) < 0 {
					l.pos = i
					return nil, false, l.syntax(`bad \u escape`)
				}
				i += 6
			default:
				l.pos = i
				return nil, false, l.syntax("bad escape")
			}
		case c < 0x20:
			l.pos = i
			return nil, false, l.syntax("control character in string")
		default:
			i++
		}
	}
	l.pos = len(d)
	return nil, false, l.syntax("unterminated string")
}

// specials marks, in bit 7 of each byte, the bytes of w (eight string
// bytes, little-endian) that plain does not: a quote, a backslash or a
// control character. Each term is the classic "has a byte below n" test: a
// byte that matches is always marked, and a byte that does not is marked
// only above (after) one that does (a borrow starts at a match), so the
// lowest mark is exact.
func specials(w uint64) uint64 {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	q, b := w^(ones*'"'), w^(ones*'\\')
	return ((q-ones)&^q | (b-ones)&^b | (w-ones*0x20)&^w) & highs
}

// plain marks the bytes that need no attention inside a string: all but the
// quote, the backslash and control characters.
var plain = func() (t [256]bool) {
	for c := range t {
		t[c] = c >= 0x20 && c != '"' && c != '\\'
	}
	return t
}()

// hex4 decodes four hex digits, or returns -1.
func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return -1
		}
		r = r<<4 | rune(c)
	}
	return r
}

// unescape decodes the escapes of raw (already checked by str) into l.buf.
// valid is false if an escape names a lone surrogate, which is not a
// character: the caller rejects such a string where validity matters.
func (l *lexer) unescape(raw []byte) (out []byte, valid bool) {
	b := l.buf[:0]
	valid = true
	for i := 0; i < len(raw); {
		c := raw[i]
		if c != '\\' {
			b = append(b, c)
			i++
			continue
		}
		switch raw[i+1] {
		case 'b':
			b = append(b, '\b')
		case 'f':
			b = append(b, '\f')
		case 'n':
			b = append(b, '\n')
		case 'r':
			b = append(b, '\r')
		case 't':
			b = append(b, '\t')
		case 'u':
			r := hex4(raw[i+2:])
			i += 6
			if utf16.IsSurrogate(r) {
				if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
					if r2 := utf16.DecodeRune(r, hex4(raw[i+2:])); r2 != utf8.RuneError {
						b = utf8.AppendRune(b, r2)
						i += 6
						continue
					}
				}
				valid = false
				r = utf8.RuneError
			}
			b = utf8.AppendRune(b, r)
			continue
		default: // '"', '\\', '/'
			b = append(b, raw[i+1])
		}
		i += 2
	}
	l.buf = b
	return b, valid
}

// numClass says what kind of number number() read. Only numInt has a value;
// the others are type or range problems of the caller, not syntax errors.
type numClass uint8

const (
	numInt      numClass = iota // an integer literal within int64
	numFrac                     // has a fraction or an exponent (1.0, 1e3)
	numOverflow                 // an integer literal outside int64
)

// number reads a JSON number and classifies it.
func (l *lexer) number() (v int64, cls numClass, err error) {
	d := l.data
	i := l.pos
	neg := i < len(d) && d[i] == '-'
	if neg {
		i++
	}
	if i >= len(d) || d[i] < '0' || d[i] > '9' {
		l.pos = i
		return 0, 0, l.syntax("bad number")
	}
	var u uint64
	ok := true
	if d[i] == '0' {
		i++
	} else {
		for ; i < len(d) && '0' <= d[i] && d[i] <= '9'; i++ {
			if u > (math.MaxUint64-9)/10 {
				ok = false // keep scanning: the syntax may still be fine
			}
			u = u*10 + uint64(d[i]-'0')
		}
	}
	frac := false
	if i < len(d) && d[i] == '.' {
		frac = true
		i++
		if i >= len(d) || d[i] < '0' || d[i] > '9' {
			l.pos = i
			return 0, 0, l.syntax("bad fraction")
		}
		for i < len(d) && '0' <= d[i] && d[i] <= '9' {
			i++
		}
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		frac = true
		i++
		if i < len(d) && (d[i] == '+' || d[i] == '-') {
			i++
		}
		if i >= len(d) || d[i] < '0' || d[i] > '9' {
			l.pos = i
			return 0, 0, l.syntax("bad exponent")
		}
		for i < len(d) && '0' <= d[i] && d[i] <= '9' {
			i++
		}
	}
	l.pos = i
	switch {
	case frac:
		return 0, numFrac, nil
	case ok && neg && u <= 1<<63:
		return -int64(u), numInt, nil
	case ok && !neg && u <= math.MaxInt64:
		return int64(u), numInt, nil
	}
	return 0, numOverflow, nil
}

// literal consumes the keyword lit (true, false or null) at l.pos.
func (l *lexer) literal(lit string) error {
	if len(l.data)-l.pos < len(lit) || string(l.data[l.pos:l.pos+len(lit)]) != lit {
		return l.syntax("bad literal")
	}
	l.pos += len(lit)
	return nil
}

// skip reads and discards one value of any type; depth is the number of
// objects and arrays around it.
func (l *lexer) skip(depth int) error {
	c := l.peek()
	if (c == '{' || c == '[') && depth >= maxDepth {
		return l.syntax("nesting too deep")
	}
	switch c {
	case '"':
		_, _, err := l.str()
		return err
	case '{':
		for more := !l.open('}'); more; {
			if _, err := l.key(); err != nil {
				return err
			}
			if err := l.skip(depth + 1); err != nil {
				return err
			}
			var err error
			if more, err = l.next('}'); err != nil {
				return err
			}
		}
		return nil
	case '[':
		for more := !l.open(']'); more; {
			if err := l.skip(depth + 1); err != nil {
				return err
			}
			var err error
			if more, err = l.next(']'); err != nil {
				return err
			}
		}
		return nil
	case 't':
		return l.literal("true")
	case 'f':
		return l.literal("false")
	case 'n':
		return l.literal("null")
	default:
		if c == '-' || ('0' <= c && c <= '9') {
			_, _, err := l.number()
			return err
		}
		return l.syntax("expected a value")
	}
}

// kind names the JSON type that starts with c, for wrong-type messages.
func kind(c byte) string {
	switch c {
	case '"':
		return "string"
	case '{':
		return "object"
	case '[':
		return "array"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number"
}
