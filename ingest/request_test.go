package ingest

import (
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

func TestDecodeLookupProtocolExample(t *testing.T) {
	hs, err := DecodeLookup([]byte(`{"hashes":["00ff","a1b2c3"]}`), Limits{})
	require.NoError(t, err)
	require.Equal(t, []messages.Hash{"\x00\xff", "\xa1\xb2\xc3"}, hs)

	hs, err = DecodeLookup([]byte(`{"hashes":[]}`), Limits{})
	require.NoError(t, err)
	require.Empty(t, hs)
}

func TestDecodeLoadProtocolExample(t *testing.T) {
	l, err := DecodeLoad([]byte(`{"request":"r2","hashes":["aa","bb"],"num_tokens":24,"blocks":[[5,6,7],[0,0,9]]}`), Limits{})
	require.NoError(t, err)
	require.Equal(t, Load{
		Request: "r2", Hashes: []messages.Hash{"\xaa", "\xbb"}, NumTokens: 24,
		Blocks: [][]messages.BlockID{{5, 6, 7}, {0, 0, 9}},
	}, l)
}

func TestDecodeLookupRejects(t *testing.T) {
	for name, body := range map[string]string{
		"invalid JSON":     `{"hashes":[}`,
		"not an object":    `["aa"]`,
		"uppercase hash":   `{"hashes":["AA"]}`,
		"odd-length hash":  `{"hashes":["a"]}`,
		"empty hash":       `{"hashes":[""]}`,
		"number hash":      `{"hashes":[1]}`,
		"too many hashes":  `{"hashes":["aa","bb","cc"]}`,
		"hashes an object": `{"hashes":{}}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeLookup([]byte(body), Limits{MaxIDs: 2})
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestDecodeLoadRejects(t *testing.T) {
	for name, body := range map[string]string{
		"missing request":      `{"hashes":[],"num_tokens":0,"blocks":[]}`,
		"request over 256":     `{"request":"` + strings.Repeat("r", 257) + `","num_tokens":0}`,
		"negative num_tokens":  `{"request":"r","num_tokens":-1}`,
		"string num_tokens":    `{"request":"r","num_tokens":"1"}`,
		"bad hash":             `{"request":"r","hashes":["xx"]}`,
		"negative block id":    `{"request":"r","blocks":[[-1]]}`,
		"block id over uint32": `{"request":"r","blocks":[[4294967296]]}`,
		"too many groups":      `{"request":"r","blocks":[[],[],[]]}`,
		"too many ids":         `{"request":"r","blocks":[[1,2,3]]}`,
		"fractional id":        `{"request":"r","blocks":[[1.5]]}`,
		"invalid UTF-8":        "{\"request\":\"\xff\"}",
		// encoding/json would replace it by U+FFFD: "r\ud800" and "r\udbff"
		// would both name "r\ufffd" (PROTOCOL.md: rejected, never replaced).
		"lone surrogate":            `{"request":"r\ud800"}`,
		"lone low surrogate, cased": `{"REQUEST":"\uDC00x"}`,
		"lone surrogate, last wins": `{"request":"r","request":"\ud83d"}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeLoad([]byte(body), Limits{MaxIDs: 2, MaxGroups: 2})
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

// A heartbeat's epoch and seq are what a batch's may be: an epoch a batch
// could never continue (empty, over MaxEpochBytes, not a string) or a seq
// no batch could carry (2^63 and above) is refused, so a malformed
// heartbeat cannot begin an epoch and reset every request, nor resync the
// live one over a tail that cannot exist.
func TestDecodeHeartbeat(t *testing.T) {
	hb, err := DecodeHeartbeat([]byte(`{"epoch":"a","seq":3}`))
	require.NoError(t, err)
	require.Equal(t, messages.HeartbeatRequest{Epoch: "a", Seq: 3}, hb)
	hb, err = DecodeHeartbeat([]byte(`{"epoch":"a","seq":0}`))
	require.NoError(t, err, "seq 0: before the epoch's first batch")
	require.Equal(t, messages.HeartbeatRequest{Epoch: "a"}, hb)
	hb, err = DecodeHeartbeat([]byte(`{"epoch":"a","seq":9223372036854775807}`))
	require.NoError(t, err, "2^63-1, a batch's largest seq")
	require.Equal(t, uint64(math.MaxInt64), hb.Seq)
	for name, body := range map[string]string{
		"null":           `null`,
		"not an object":  `[1]`,
		"invalid JSON":   `{"epoch":`,
		"no epoch":       `{"seq":1}`,
		"empty epoch":    `{"epoch":"","seq":1}`,
		"epoch over 256": `{"epoch":"` + strings.Repeat("e", MaxEpochBytes+1) + `","seq":1}`,
		"number epoch":   `{"epoch":1,"seq":1}`,
		"negative seq":   `{"epoch":"a","seq":-1}`,
		"seq 2^63":       `{"epoch":"a","seq":9223372036854775808}`,
		"seq 2^64-1":     `{"epoch":"a","seq":18446744073709551615}`,
		"not UTF-8":      "{\"epoch\":\"\xff\",\"seq\":1}",
		"lone surrogate": `{"epoch":"e\ud800","seq":1}`, // a batch's epoch cannot be it
		"no seq":         `{"epoch":"a"}`,               // the table says malformed: it was read as 0
		"null seq":       `{"epoch":"a","seq":null}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeHeartbeat([]byte(body))
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}
