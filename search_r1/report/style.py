"""The CSS both pages carry, and the run page's few lines of script (they only switch sample steps)."""

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{margin:0 0 6px;font-size:22px} h2{font-size:17px;margin:18px 0 6px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:10px 0 4px}
header dl{display:grid;grid-template-columns:max-content 1fr;gap:0 12px;margin:0}
header dt{color:#666} header dd{margin:0}
.latest{font-weight:600} .note{color:#8a5a00;font-style:italic}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:6px 14px}
figure{margin:0} figcaption{font-weight:600}
.chart .grid{stroke:#e6e6e6} .chart text{font-size:10px;fill:#555}
.chart .ylab{text-anchor:end} .chart .xlab{text-anchor:middle}
.chart .series{fill:none;stroke-width:2.5;stroke-linejoin:round}
.legend{font-size:12px} .legend span{margin-right:10px;white-space:nowrap}
.legend i,i.sw{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}
table{border-collapse:collapse;margin:4px 0 8px} td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.hbar{display:inline-block;width:90px;height:9px;background:#f0f0f0;vertical-align:middle}
.hbar i{display:block;height:100%}
details.traj{border:1px solid #ddd;border-radius:4px;margin:4px 0;padding:2px 8px}
details.traj summary{cursor:pointer} .good{color:#1d6b2f} .bad{color:#a02020}
.gold{color:#666;margin-left:12px}
.response{white-space:pre-wrap;font:12px/1.5 ui-monospace,monospace;margin:6px 0}
.seg{border-radius:2px} .tag{font-weight:700;color:#444}
.seg-think{background:#fff0b3} .seg-search{background:#c9e4ff} .seg-answer{background:#c5f2cf}
.seg-info{background:#d9d4e7;color:#444}
.masked{font:italic 10px system-ui,sans-serif;background:#6b5b95;color:#fff;padding:0 4px;
  margin-right:4px;border-radius:2px}
.swatch{padding:1px 6px;margin-right:8px;font:12px ui-monospace,monospace}
"""

# Only switches which sample step is shown; without scripts every step is shown one after another.
JS = """
const pick = document.getElementById('sample-step');
if (pick) {
  const show = () => document.querySelectorAll('.samples').forEach(s => { s.hidden = s.id !== pick.value; });
  pick.addEventListener('change', show);
  document.getElementById('step-picker').hidden = false;
  show();
}
"""
