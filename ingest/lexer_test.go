package ingest

import (
	"encoding/binary"
	"math/bits"
	"strings"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"
)

// TestSpecialsFindsTheFirstByteNotPlain checks the eight-byte scan against
// the byte table it stands for: no mark when every byte is plain, else the
// lowest mark on the first byte that is not. On random words and on words
// built from the bytes around each boundary (0x1f/0x20, '"', '\\',
// 0x7f/0x80, 0xff).
func TestSpecialsFindsTheFirstByteNotPlain(t *testing.T) {
	first := func(w uint64) int { // 8: none
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], w)
		for i, c := range b {
			if !plain[c] {
				return i
			}
		}
		return 8
	}
	got := func(w uint64) int {
		if m := specials(w); m != 0 {
			return bits.TrailingZeros64(m) / 8
		}
		return 8
	}
	require.NoError(t, quick.Check(func(w uint64) bool { return got(w) == first(w) }, &quick.Config{MaxCount: 200000}))
	edges := []byte{0x00, 0x01, 0x1f, 0x20, 0x21, '"' - 1, '"', '"' + 1, '\\' - 1, '\\', '\\' + 1, 0x7f, 0x80, 0x81, 0xa2, 0xdc, 0xfe, 0xff}
	var b [8]byte
	for i := range 200000 {
		for j := range b {
			b[j] = edges[(i*7+j*13+i/len(edges)*j)%len(edges)]
		}
		w := binary.LittleEndian.Uint64(b[:])
		require.Equal(t, first(w), got(w), "% x", b)
	}
	for pos := range 8 { // one special byte at each position among plain ones
		for _, c := range []byte{0x00, 0x1f, '"', '\\'} {
			for j := range b {
				b[j] = 'a'
			}
			b[pos] = c
			require.Equal(t, pos, got(binary.LittleEndian.Uint64(b[:])), "% x", b)
		}
	}
}

// TestStrFindsTheEndAtEveryOffset reads strings whose quote, escape or
// control character falls at each offset of the eight-byte scan, and at
// the end of the data.
func TestStrFindsTheEndAtEveryOffset(t *testing.T) {
	for n := range 40 {
		body := strings.Repeat("x", n)
		l := lexer{data: []byte(`"` + body + `" `)}
		raw, esc, err := l.str()
		require.NoError(t, err)
		require.False(t, esc)
		require.Equal(t, body, string(raw))
		require.Equal(t, n+2, l.pos)

		l = lexer{data: []byte(`"` + body + `\n"`)}
		raw, esc, err = l.str()
		require.NoError(t, err)
		require.True(t, esc)
		require.Equal(t, body+`\n`, string(raw))

		l = lexer{data: []byte(`"` + body + "\x01\"")}
		_, _, err = l.str()
		require.ErrorIs(t, err, ErrMalformed)
		require.Equal(t, n+1, l.pos, "the control character's offset")

		l = lexer{data: []byte(`"` + body)}
		_, _, err = l.str()
		require.ErrorIs(t, err, ErrMalformed, "unterminated")
	}
}
