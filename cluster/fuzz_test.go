package cluster

import (
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/messages"
)

// Any fetch request body, from any peer: an error, or a piece inside the
// chunk no larger than asked or than max_payload allows, with headers that
// describe it.
func FuzzFetchPiece(f *testing.F) {
	for _, seed := range []string{
		`{"namespace":"m","key":"6b","offset":0,"max":1048576}`,
		`{"namespace":"m","key":"6b","offset":99999,"max":1}`,
		`{"namespace":"m","key":"6b","offset":100000,"max":5}`,
		`{"namespace":"m","key":"6b","offset":-1,"max":5}`,
		`{"namespace":"m","key":"zz","max":5}`, `{`, ``,
	} {
		f.Add([]byte(seed))
	}
	chunk := randomBytes(1, 100_000)
	src := newMemSource()
	src.put("m", "k", chunk)
	const maxPayload = 64 << 10
	f.Fuzz(func(t *testing.T, body []byte) {
		h := nats.Header{}
		piece, err := fetchPiece(maxPayload, body, src, h)
		if err != nil {
			require.Nil(t, piece)
			return
		}
		off, err := strconv.ParseInt(h.Get(HeaderOffset), 10, 64)
		require.NoError(t, err)
		require.LessOrEqual(t, int64(len(piece)), int64(maxPayload-messages.HeaderRoom))
		require.Equal(t, chunk[off:off+int64(len(piece))], piece)
		require.Equal(t, strconv.Itoa(len(chunk)), h.Get(HeaderSize))
	})
}

// Any keys request: an error reply, or keys in order after the cursor,
// within the budget.
func FuzzKeysPage(f *testing.F) {
	for _, seed := range []string{`{}`, `{"after":{"namespace":"a","key":"01"}}`, `{"after":{"namespace":"a","key":"zz"}}`, `{"after":null}`, `[`} {
		f.Add([]byte(seed))
	}
	var keys []holders.NSKey
	for i := range 300 {
		keys = append(keys, holders.NSKey{NS: string(rune('a' + i%3)), Key: messages.Key([]byte{byte(i), byte(i >> 8)})})
	}
	src := NewSortedKeys(keys)
	const budget = 4096
	f.Fuzz(func(t *testing.T, body []byte) {
		rep := keysPage(budget, body, src)
		if rep.Error != "" {
			require.Empty(t, rep.Keys)
			return
		}
		size := 0
		for _, k := range rep.Keys {
			size += len(k.Namespace) + len(k.Key)
		}
		require.LessOrEqual(t, size, budget)
	})
}

// A max_payload too small for a piece is refused, not a panic in the
// NATS handler.
func TestFetchPieceWithTinyMaxPayload(t *testing.T) {
	src := newMemSource()
	src.put("m", "k", randomBytes(1, 4096))
	for _, mp := range []int64{0, 512, messages.HeaderRoom} {
		piece, err := fetchPiece(mp, []byte(`{"namespace":"m","key":"6b","offset":0,"max":1048576}`), src, nats.Header{})
		require.ErrorIs(t, err, ErrFetchInput, "max_payload %d", mp)
		require.Nil(t, piece)
	}
}
