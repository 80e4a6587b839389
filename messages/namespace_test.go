package messages

import (
	"testing"
	"testing/quick"
)

// NamespaceKey gives two (engine, name) pairs one key exactly when they name
// one namespace: an engine's own (named by default or outright) is the same
// namespace only for that engine, a shared name the same for every engine
// naming it, and never the other kind. Engine ids have no '.' (they are
// one subject token); names are anything.
func TestNamespaceKeyIsOneKeyPerNamespace(t *testing.T) {
	own := func(engine, name string) bool { return name == "" || name == engine }
	same := func(e1, n1, e2, n2 string) bool {
		switch {
		case own(e1, n1) && own(e2, n2):
			return e1 == e2
		case !own(e1, n1) && !own(e2, n2):
			return n1 == n2
		}
		return false
	}
	// Small alphabets, so that collisions are common; a third of the names
	// are an engine id, as a squatter would pick.
	id := func(b byte) string { return []string{"vic", "mal", "e1"}[int(b)%3] }
	name := func(b byte, s string) string {
		switch b % 4 {
		case 0:
			return ""
		case 1:
			return id(b / 4)
		case 2:
			return "." + id(b/4) // a shared name that looks like a key
		}
		return s
	}
	f := func(a, b, c, d byte, s1, s2 string) bool {
		e1, n1, e2, n2 := id(a), name(b, s1), id(c), name(d, s2)
		return (NamespaceKey(e1, n1) == NamespaceKey(e2, n2)) == same(e1, n1, e2, n2)
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 20000}); err != nil {
		t.Fatal(err)
	}
}

// ClusterNamespace round-trips, and no NamespaceKey reads as one: a key from
// a node that names no geometry (an older version) never matches one.
func TestClusterNamespaceRoundTripsAndNoPlainKeyReadsAsOne(t *testing.T) {
	const idChars = "0123456789abcdefABCDEF_-xyz"
	f := func(id []byte, name string, geo uint64) bool {
		engine := "e" // an engine id: [A-Za-z0-9_-]{1,64}
		for _, b := range id[:min(len(id), 63)] {
			engine += string(idChars[int(b)%len(idChars)])
		}
		key := NamespaceKey(engine, name)
		k, g, ok := SplitClusterNamespace(ClusterNamespace(key, geo))
		if !ok || k != key || g != geo {
			return false
		}
		_, _, plain := SplitClusterNamespace(key)
		return !plain
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"0123456789abcdef", ".0123456789abcde:e1", "0123456789abcdef:"} {
		if _, _, ok := SplitClusterNamespace(key); ok {
			t.Errorf("%q reads as a cluster namespace", key)
		}
	}
}
