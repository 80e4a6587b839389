package ingest

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// TestDecodeBatchRejectsOneEvent: each bad event sits between two good ones;
// it alone is left out and reported (index, type, request, reason), and the
// good events keep their order (PROTOCOL.md "Events in a batch apply in
// order").
func TestDecodeBatchRejectsOneEvent(t *testing.T) {
	long := strings.Repeat("r", 257)
	for _, tc := range []struct {
		name    string
		event   string
		reason  error
		typ     string
		request string
	}{
		{"not an object", `[1]`, ErrWrongType, "", ""},
		{"a string event", `"added"`, ErrWrongType, "", ""},
		{"missing type", `{"request":"r"}`, ErrUnknownType, "", "r"},
		{"unknown type", `{"type":"evicted","request":"r"}`, ErrUnknownType, "evicted", "r"},
		{"type is case-sensitive", `{"type":"Added","request":"r","prompt_tokens":1}`, ErrUnknownType, "Added", "r"},
		{"type not a string", `{"type":1,"request":"r"}`, ErrWrongType, "", "r"},
		{"missing request", `{"type":"resumed"}`, ErrBadRequestID, "resumed", ""},
		{"null request", `{"type":"resumed","request":null}`, ErrBadRequestID, "resumed", ""},
		{"keys are case-sensitive", `{"type":"resumed","Request":"r"}`, ErrBadRequestID, "resumed", ""},
		{"empty request", `{"type":"resumed","request":""}`, ErrBadRequestID, "resumed", ""},
		{"request over 256 bytes", `{"type":"resumed","request":"` + long + `"}`, ErrBadRequestID, "resumed", ""},
		{"request not UTF-8", "{\"type\":\"resumed\",\"request\":\"a\xffb\"}", ErrBadRequestID, "resumed", ""},
		{"request lone surrogate", `{"type":"resumed","request":"\udc00"}`, ErrBadRequestID, "resumed", ""},
		{"request a number", `{"type":"resumed","request":7}`, ErrBadRequestID, "resumed", ""},
		{"string where an int goes", `{"type":"added","request":"r","prompt_tokens":"5"}`, ErrWrongType, "added", "r"},
		{"fraction where an int goes", `{"type":"tokens","request":"r","computed":1.5,"total":2}`, ErrWrongType, "tokens", "r"},
		{"exponent where an int goes", `{"type":"tokens","request":"r","computed":1e2,"total":200}`, ErrWrongType, "tokens", "r"},
		{"bool where an int goes", `{"type":"tokens","request":"r","computed":true}`, ErrWrongType, "tokens", "r"},
		{"int where a bool goes", `{"type":"finished","request":"r","aborted":1}`, ErrWrongType, "finished", "r"},
		{"object where an array goes", `{"type":"blocks","request":"r","ids":{}}`, ErrWrongType, "blocks", "r"},
		{"string where ids go", `{"type":"blocks","request":"r","ids":"1,2"}`, ErrWrongType, "blocks", "r"},
		{"string id", `{"type":"blocks","request":"r","ids":[1,"2"]}`, ErrWrongType, "blocks", "r"},
		{"fractional id", `{"type":"blocks","request":"r","ids":[1.5]}`, ErrWrongType, "blocks", "r"},
		{"negative id", `{"type":"blocks","request":"r","ids":[-1]}`, ErrOutOfRange, "blocks", "r"},
		{"id over uint32", `{"type":"blocks","request":"r","ids":[4294967296]}`, ErrOutOfRange, "blocks", "r"},
		{"id over int64", `{"type":"blocks","request":"r","ids":[99999999999999999999]}`, ErrOutOfRange, "blocks", "r"},
		{"negative start", `{"type":"hashes","request":"r","start":-1,"hashes":[]}`, ErrOutOfRange, "hashes", "r"},
		{"negative group", `{"type":"blocks","request":"r","group":-1,"ids":[]}`, ErrOutOfRange, "blocks", "r"},
		{"group over the group limit", `{"type":"blocks","request":"r","group":64,"ids":[]}`, ErrOutOfRange, "blocks", "r"},
		{"negative prompt_tokens", `{"type":"added","request":"r","prompt_tokens":-5}`, ErrOutOfRange, "added", "r"},
		{"negative max_offload_tokens", `{"type":"added","request":"r","prompt_tokens":5,"max_offload_tokens":-1}`, ErrOutOfRange, "added", "r"},
		{"negative computed", `{"type":"tokens","request":"r","computed":-1,"total":1}`, ErrOutOfRange, "tokens", "r"},
		{"negative total", `{"type":"finished","request":"r","computed":0,"total":-1}`, ErrOutOfRange, "finished", "r"},
		{"count over int64", `{"type":"tokens","request":"r","computed":9223372036854775808}`, ErrOutOfRange, "tokens", "r"},
		{"negative count in a field the type does not use", `{"type":"resumed","request":"r","start":-1}`, ErrOutOfRange, "resumed", "r"},
		{"uppercase hex hash", `{"type":"hashes","request":"r","hashes":["AB"]}`, ErrBadHash, "hashes", "r"},
		{"odd-length hash", `{"type":"hashes","request":"r","hashes":["abc"]}`, ErrBadHash, "hashes", "r"},
		{"empty hash", `{"type":"hashes","request":"r","hashes":[""]}`, ErrBadHash, "hashes", "r"},
		{"non-hex hash", `{"type":"hashes","request":"r","hashes":["zz"]}`, ErrBadHash, "hashes", "r"},
		{"0x-prefixed hash", `{"type":"hashes","request":"r","hashes":["0xab"]}`, ErrBadHash, "hashes", "r"},
		{"hash over 64 bytes", `{"type":"hashes","request":"r","hashes":["` + strings.Repeat("ab", 65) + `"]}`, ErrBadHash, "hashes", "r"},
		{"number where a hash goes", `{"type":"hashes","request":"r","hashes":[12]}`, ErrWrongType, "hashes", "r"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := `{"epoch":"e","seq":1,"events":[{"type":"added","request":"a","prompt_tokens":1},` +
				tc.event + `,{"type":"resumed","request":"b"}]}`
			b, bad, err := DecodeBatch("e1", []byte(body), Limits{})
			require.NoError(t, err)
			require.Equal(t, []messages.Event{
				{Type: messages.EvAdded, Request: "a", PromptTokens: 1, MaxOffloadTokens: -1},
				{Type: messages.EvResumed, Request: "b"},
			}, b.Events)
			require.Len(t, bad, 1)
			require.Equal(t, 1, bad[0].Index)
			require.Equal(t, tc.typ, bad[0].Type)
			require.Equal(t, tc.request, bad[0].Request)
			require.ErrorIs(t, bad[0].Err, ErrBadEvent)
			require.ErrorIs(t, bad[0], tc.reason)
			require.NotEqual(t, "other", messages.RejectLabel(bad[0].Err))
		})
	}
}

func TestDecodeBatchRejectsArraysOverMaxIDs(t *testing.T) {
	lim := Limits{MaxIDs: 2}
	for _, tc := range []struct{ name, event string }{
		{"too many ids", `{"type":"blocks","request":"r","ids":[1,2,3]}`},
		{"too many hashes", `{"type":"hashes","request":"r","hashes":["01","02","03"]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, bad, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[`+tc.event+`]}`), lim)
			require.NoError(t, err)
			require.Empty(t, b.Events)
			require.Len(t, bad, 1)
			require.ErrorIs(t, bad[0], ErrTooLarge)
		})
	}
}

func TestDecodeBatchReportsEveryBadEvent(t *testing.T) {
	b, bad, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[
		{"type":"x","request":"r"}, {"type":"resumed","request":"ok"}, 5, {"type":"resumed"}]}`), Limits{})
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	require.Len(t, bad, 3)
	for i, want := range []int{0, 2, 3} {
		require.Equal(t, want, bad[i].Index)
	}
}

func TestDecodeBatchTruncatesLongUnknownType(t *testing.T) {
	_, bad, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[{"type":"`+strings.Repeat("t", 1000)+`","request":"r"}]}`), Limits{})
	require.NoError(t, err)
	require.Len(t, bad, 1)
	require.Len(t, bad[0].Type, maxTypeBytes)
}

func TestRejectLabel(t *testing.T) {
	require.Equal(t, "wrong_type", messages.RejectLabel(EventError{Err: ErrWrongType}))
	require.Equal(t, "malformed", messages.RejectLabel(ErrMalformed))
	require.Equal(t, "other", messages.RejectLabel(nil))
}
