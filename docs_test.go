package redisdlm

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// docFiles are the user documentation: README.md and every docs/*.md.
func docFiles(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"README.md"}, pages...)
}

// fencedBlock is one ``` fenced block of a Markdown file.
type fencedBlock struct {
	lang string // the word after the opening fence ("caddyfile", "json", "")
	line int    // line number of the opening fence
	text string // the lines inside, the fence's own indentation removed
}

var (
	fenceRe      = regexp.MustCompile("^([ \t>]*)```+\\s*([A-Za-z0-9_+-]*)")
	closeFenceRe = regexp.MustCompile("^[ \t>]*```+\\s*$")
)

// markdown is a Markdown file split into its fenced blocks and its prose
// lines (fenced lines blanked, so that line numbers still match).
type markdown struct {
	blocks []fencedBlock
	prose  []string
}

func readMarkdown(t *testing.T, name string) markdown {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var md markdown
	var cur *fencedBlock
	var indent string
	var body []string
	for i, line := range strings.Split(string(b), "\n") {
		m := fenceRe.FindStringSubmatch(line)
		switch {
		case cur == nil && m != nil:
			cur = &fencedBlock{lang: strings.ToLower(m[2]), line: i + 1}
			indent, body = m[1], nil
			md.prose = append(md.prose, "")
		case cur != nil && closeFenceRe.MatchString(line):
			cur.text = strings.Join(body, "\n")
			md.blocks = append(md.blocks, *cur)
			cur = nil
			md.prose = append(md.prose, "")
		case cur != nil:
			body = append(body, strings.TrimPrefix(line, indent))
			md.prose = append(md.prose, "")
		default:
			md.prose = append(md.prose, line)
		}
	}
	if cur != nil {
		t.Errorf("%s:%d: fenced block never closed", name, cur.line)
	}
	return md
}

// TestDocsCaddyfilesFormatted: every ```caddyfile block of the README and
// docs/ is as `caddy fmt` writes it (tabs, one space between tokens), so a
// user who pastes one and runs caddy fmt sees no change. Syntax summaries
// with aligned comments are fenced as ```text and not checked.
func TestDocsCaddyfilesFormatted(t *testing.T) {
	t.Parallel()
	checked := 0
	for _, name := range docFiles(t) {
		for _, b := range readMarkdown(t, name).blocks {
			if b.lang != "caddyfile" {
				continue
			}
			checked++
			got := bytes.TrimSpace([]byte(b.text))
			want := bytes.TrimSpace(caddyfile.Format([]byte(b.text)))
			if !bytes.Equal(got, want) {
				t.Errorf("%s:%d: ```caddyfile block is not caddy fmt clean (- as written, + as caddy fmt writes it):\n%s", name, b.line, lineDiff(string(got), string(want)))
			}
		}
	}
	if checked == 0 {
		t.Fatal("found no ```caddyfile block in README.md or docs/")
	}
	t.Logf("%d Caddyfile blocks checked", checked)
}

// lineDiff shows the lines that differ, one pair each.
func lineDiff(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	var out strings.Builder
	shown := 0
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl == wl {
			continue
		}
		if shown++; shown > 8 {
			fmt.Fprintf(&out, "(and more)\n")
			break
		}
		fmt.Fprintf(&out, "block line %d:\n-\t%q\n+\t%q\n", i+1, gl, wl)
	}
	return out.String()
}

var (
	linkRe    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	headingRe = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	anchorRe  = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
)

// slug is the anchor GitHub gives a heading: lowercased, every character
// but letters, digits, spaces, '-' and '_' dropped, spaces made '-'.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors are the fragment names a Markdown file defines: its headings'
// slugs (a repeated one gets -1, -2, ...) and explicit <a id="...">.
func anchors(md markdown) map[string]bool {
	out := map[string]bool{}
	for _, line := range md.prose {
		for _, m := range anchorRe.FindAllStringSubmatch(line, -1) {
			out[m[1]] = true
		}
		m := headingRe.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		s := slug(m[1])
		for i := 1; out[s]; i++ {
			s = fmt.Sprintf("%s-%d", slug(m[1]), i)
		}
		out[s] = true
	}
	return out
}

// TestDocsLinks: every relative link of the README and docs/ points to a
// file of the repository, and a #fragment into a Markdown file to one of
// its headings (or an <a id>); links into code blocks are not links. The
// README names nothing outside the repository: no http(s) links.
func TestDocsLinks(t *testing.T) {
	t.Parallel()
	pages := map[string]markdown{}
	load := func(name string) markdown {
		if md, ok := pages[name]; ok {
			return md
		}
		md := readMarkdown(t, name)
		pages[name] = md
		return md
	}
	links := 0
	for _, name := range docFiles(t) {
		md := load(name)
		for i, line := range md.prose {
			for _, m := range linkRe.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					if name == "README.md" {
						t.Errorf("%s:%d: links outside the repository (%s); the README refers only to the repository", name, i+1, target)
					}
					continue
				}
				links++
				file, frag, _ := strings.Cut(target, "#")
				path := name
				if file != "" {
					path = filepath.Join(filepath.Dir(name), file)
					if _, err := os.Stat(path); err != nil {
						t.Errorf("%s:%d: link %s: %s does not exist", name, i+1, target, path)
						continue
					}
				}
				if frag == "" || !strings.HasSuffix(path, ".md") {
					continue
				}
				if !anchors(load(path))[frag] {
					t.Errorf("%s:%d: link %s: %s has no heading or anchor %q", name, i+1, target, path, frag)
				}
			}
		}
	}
	if links == 0 {
		t.Fatal("found no relative link in README.md or docs/")
	}
	t.Logf("%d relative links checked", links)
}
