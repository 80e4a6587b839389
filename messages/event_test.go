package messages_test

import (
	"testing"

	"github.com/kvactors/kvactors/messages"
)

// TestEventTypeNames: every event type's protocol name parses back to it,
// anything else (a prefix, a case change, empty) is 0, and parsing the
// decoder's bytes allocates nothing (it runs once per event).
func TestEventTypeNames(t *testing.T) {
	for typ := messages.EvAdded; typ <= messages.EvFinished; typ++ {
		if got := messages.ParseEventType([]byte(typ.String())); got != typ {
			t.Errorf("ParseEventType(%q) = %v, want %v", typ.String(), got, typ)
		}
	}
	for _, bad := range []string{"", "add", "Added", "finished ", "EventType(1)"} {
		if got := messages.ParseEventType([]byte(bad)); got != 0 {
			t.Errorf("ParseEventType(%q) = %v, want 0", bad, got)
		}
	}
	name := []byte("finished")
	if n := testing.AllocsPerRun(100, func() { messages.ParseEventType(name) }); n != 0 {
		t.Errorf("ParseEventType allocates %v times per call", n)
	}
}
