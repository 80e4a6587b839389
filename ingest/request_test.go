package ingest

import (
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
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeLoad([]byte(body), Limits{MaxIDs: 2, MaxGroups: 2})
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}
