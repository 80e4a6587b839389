package ingest

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidEngineID(t *testing.T) {
	for id, want := range map[string]bool{
		"e1":                    true,
		"A-z_0-9":               true,
		strings.Repeat("x", 64): true,
		"":                      false,
		strings.Repeat("x", 65): false,
		"a.b":                   false,
		"a*":                    false,
		">":                     false,
		"a b":                   false,
		"é":                     false,
		"_node":                 false, // PROTOCOL.md "Words": ids starting with _ are reserved
		"_":                     false,
		"a_":                    true,
	} {
		require.Equal(t, want, ValidEngineID(id), "%q", id)
	}
}

func TestParseSubject(t *testing.T) {
	for _, tc := range []struct {
		name, prefix, subject, engine, verb string
	}{
		{"default prefix", "kvactors", "kvactors.e1.events", "e1", "events"},
		{"dotted prefix", "a.b", "a.b.gpu-0.register", "gpu-0", "register"},
		{"verb is not checked against the known verbs", "kvactors", "kvactors.e1.future", "e1", "future"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			engine, verb, err := ParseSubject(tc.prefix, tc.subject)
			require.NoError(t, err)
			require.Equal(t, tc.engine, engine)
			require.Equal(t, tc.verb, verb)
		})
	}
}

func TestParseSubjectRejects(t *testing.T) {
	for _, tc := range []struct{ name, prefix, subject string }{
		{"other prefix", "kvactors", "other.e1.events"},
		{"prefix is only a string prefix of the first token", "kv", "kvactors.e1.events"},
		{"no engine or verb", "kvactors", "kvactors"},
		{"no verb", "kvactors", "kvactors.e1"},
		{"empty verb", "kvactors", "kvactors.e1."},
		{"empty engine", "kvactors", "kvactors..events"},
		{"extra token", "kvactors", "kvactors.e1.events.x"},
		{"wildcard engine", "kvactors", "kvactors.*.events"},
		{"engine too long", "kvactors", "kvactors." + strings.Repeat("e", 65) + ".events"},
		{"empty prefix", "", ".e1.events"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := ParseSubject(tc.prefix, tc.subject)
			require.ErrorIs(t, err, ErrBadSubject)
		})
	}
}
