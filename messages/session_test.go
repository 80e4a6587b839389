package messages_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "kvactors' choice, replies": an engine's verbs are answered
// only in its own inbox; status in any reply inbox; kvactors' own inboxes
// and non-inbox subjects never.
func TestEngineReplyAllowed(t *testing.T) {
	for _, tc := range []struct {
		verb, reply string
		want        bool
	}{
		{messages.VerbLookup, "_INBOX.e1.abc.1", true},
		{messages.VerbRegister, "_INBOX.e1.x", true},
		{messages.VerbLookup, "_INBOX.e2.abc.1", false},
		{messages.VerbLookup, "_INBOX.e1x.abc", false},
		{messages.VerbLookup, "_INBOX.e1", false},
		{messages.VerbLookup, "_INBOX.0123456789abcdefABCDEF.1", false},
		{messages.VerbHeartbeat, "kvactors.e1.resync", false},
		{messages.VerbStatus, "_INBOX.router.1", true},
		{messages.VerbStatus, "_INBOX.e2.1", true},
		{messages.VerbStatus, "_INBOX._kvactors.1", false},
		{messages.VerbStatus, "kvactors.e2.unregister", false},
		{"nosuchverb", "_INBOX.e2.1", false},
	} {
		require.Equal(t, tc.want, messages.EngineReplyAllowed("e1", tc.verb, tc.reply), "%s on %s", tc.verb, tc.reply)
	}
}
