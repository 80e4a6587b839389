package main

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// repoRoot is the repository, from this package's directory.
const repoRoot = "../.."

// goPackageDirs returns every directory of the repository holding Go files,
// slash-separated and relative to its root (testdata and hidden ones left
// out, as the go tool does).
func goPackageDirs(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() && p != repoRoot && (name == "testdata" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(name, ".go") {
			rel, err := filepath.Rel(repoRoot, filepath.Dir(p))
			if err != nil {
				return err
			}
			if rel = filepath.ToSlash(rel); !slices.Contains(dirs, rel) {
				dirs = append(dirs, rel)
			}
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, dirs)
	return dirs
}

// README.md's Layout table names every package of the tree, and every
// package it names exists: a new, moved or removed package cannot drift
// from the map a reader starts from. A row's first cell names packages
// (`sched/`); either cell may name one below them by its path from there
// (`engine/` in the `actors/` row is actors/engine).
func TestReadmeLayoutNamesEveryPackage(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	require.NoError(t, err)
	text := string(data)
	i := strings.Index(text, "## Layout")
	require.GreaterOrEqual(t, i, 0, "README.md has a Layout section")
	quoted := regexp.MustCompile("`([a-z][a-z0-9_/]*)/`")
	named := map[string]bool{}
	rows := 0
	for _, line := range strings.Split(text[i:], "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 4 || !strings.HasPrefix(line, "| `") {
			continue
		}
		rows++
		var bases []string
		for _, m := range quoted.FindAllStringSubmatch(cells[1], -1) {
			bases = append(bases, m[1])
			info, err := os.Stat(filepath.Join(repoRoot, m[1]))
			require.NoError(t, err, "README.md's Layout names %s/, which is not in the tree", m[1])
			require.True(t, info.IsDir(), "%s is a directory", m[1])
			named[m[1]] = true
		}
		require.NotEmpty(t, bases, "row %q names no package in its first cell", line)
		for _, m := range quoted.FindAllStringSubmatch(line, -1) {
			named[m[1]] = true
			for _, b := range bases {
				named[path.Join(b, m[1])] = true
			}
		}
	}
	require.NotZero(t, rows, "README.md's Layout table")
	for _, dir := range goPackageDirs(t) {
		if dir == "." {
			continue
		}
		require.True(t, named[dir], "package %s/ is not in README.md's Layout table", dir)
	}
}

// Every package says what it owns in its package comment: a library
// package in a doc.go of its own (where a reader looks), a command in any
// of its files.
func TestEveryPackageHasADocComment(t *testing.T) {
	for _, dir := range goPackageDirs(t) {
		entries, err := os.ReadDir(filepath.Join(repoRoot, dir))
		require.NoError(t, err)
		var name string
		var docs []string
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
				continue
			}
			f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(repoRoot, dir, e.Name()), nil,
				parser.PackageClauseOnly|parser.ParseComments)
			require.NoError(t, err)
			name = f.Name.Name
			if f.Doc != nil {
				docs = append(docs, e.Name())
			}
		}
		switch name {
		case "": // tests only
		case "main":
			require.NotEmpty(t, docs, "command %s/ has no package comment (// Command …)", dir)
		default:
			require.Equal(t, []string{"doc.go"}, docs, "package %s (%s/): its package comment in doc.go, and only there", name, dir)
		}
	}
}
