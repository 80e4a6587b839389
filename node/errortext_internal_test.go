package node

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// An error reply's text is cut, at a rune, to fit any server's max_payload:
// one refused for its size leaves the requester with no answer at all.
func TestAnErrorReplysTextIsBounded(t *testing.T) {
	require.Equal(t, "no room", errorText(errors.New("no room")))
	long := errorText(errors.New(strings.Repeat("é", maxErrorText)))
	require.LessOrEqual(t, len(long), maxErrorText+len("… (cut)"))
	require.True(t, utf8.ValidString(long))
	require.True(t, strings.HasSuffix(long, "… (cut)"))
}
