package nft

import (
	"fmt"
	"strings"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// Render prints tables the way `nft list table inet NAME` prints them
// (nft 1.0.x layout: tabs, named priorities, a blank line between blocks),
// with `counter` standing for `counter packets N bytes M`.
func Render(tables ...*Table) string {
	var b strings.Builder
	for _, t := range tables {
		fmt.Fprintf(&b, "table inet %s {\n", t.Name)
		first := true
		sep := func() {
			if !first {
				b.WriteString("\n")
			}
			first = false
		}
		for _, s := range t.Sets {
			sep()
			renderSet(&b, s)
		}
		for _, c := range t.Chains {
			sep()
			fmt.Fprintf(&b, "\tchain %s {\n", c.Name)
			if c.Hook != nil {
				fmt.Fprintf(&b, "\t\ttype %s hook %s priority %s; policy accept;\n", c.Hook.Type, hookName(c.Hook.Hook), prioName(c.Hook))
			}
			for _, r := range c.Rules {
				fmt.Fprintf(&b, "\t\t%s comment %q\n", r.Text(), r.Tag())
			}
			b.WriteString("\t}\n")
		}
		b.WriteString("}\n")
	}
	return b.String()
}

func renderSet(b *strings.Builder, s *Set) {
	fmt.Fprintf(b, "\tset %s {\n", s.Name)
	fmt.Fprintf(b, "\t\ttype %s\n", s.typeName())
	if s.Interval {
		b.WriteString("\t\tflags interval\n")
	}
	perLine := s.perLine()
	if s.Comment != "" {
		fmt.Fprintf(b, "\t\tcomment %q\n", s.Comment)
	}
	if len(s.Elements) > 0 {
		b.WriteString("\t\telements = { ")
		for i, e := range s.Elements {
			if i > 0 {
				if i%perLine == 0 {
					b.WriteString(",\n\t\t\t     ")
				} else {
					b.WriteString(", ")
				}
			}
			b.WriteString(e.text())
			if e.Comment != "" {
				fmt.Fprintf(b, " comment %q", e.Comment)
			}
		}
		b.WriteString(" }\n")
	}
	b.WriteString("\t}\n")
}

func hookName(h nftables.ChainHook) string {
	switch h {
	case unix.NF_INET_PRE_ROUTING:
		return "prerouting"
	case unix.NF_INET_LOCAL_IN:
		return "input"
	case unix.NF_INET_FORWARD:
		return "forward"
	case unix.NF_INET_LOCAL_OUT:
		return "output"
	case unix.NF_INET_POST_ROUTING:
		return "postrouting"
	}
	return fmt.Sprintf("hook%d", h)
}

// prioName gives nft's standard priority names for the inet family; dstnat
// and srcnat only exist on the hooks where NAT of that kind happens.
func prioName(h *Hook) string {
	switch {
	case h.Priority == -300:
		return "raw"
	case h.Priority == -150:
		return "mangle"
	case h.Priority == -100 && h.Hook == unix.NF_INET_PRE_ROUTING:
		return "dstnat"
	case h.Priority == 0:
		return "filter"
	case h.Priority == 50:
		return "security"
	case h.Priority == 100 && h.Hook == unix.NF_INET_POST_ROUTING:
		return "srcnat"
	}
	return fmt.Sprint(h.Priority)
}
