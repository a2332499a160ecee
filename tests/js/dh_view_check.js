// Loads a DHAT file the way valgrind's dh_view.html does: runs dh_view.js's
// own buildTree() on it (with a minimal DOM stub) and prints the root's
// totals, or the error dh_view would show.
const fs = require("fs");
const vm = require("vm");
const [js, data] = [process.argv[2], process.argv[3]];
function el() {
  return new Proxy({ childNodes: [], style: {}, appendChild(c) { this.childNodes.push(c); return c; },
    addEventListener() {}, setAttribute() {}, removeChild() {}, get firstChild() { return null; } },
    { get(t, k) { return k in t ? t[k] : (typeof k === "string" ? el() : undefined); }, set(t, k, v) { t[k] = v; return true; } });
}
const ctx = { console, Intl, Math, JSON, Error, Infinity, Number, String, Array, Object, Map, Set,
  document: { getElementById: () => el(), createElement: () => el(), createTextNode: () => el(), body: el() },
  window: { addEventListener() {}, onload: null }, performance: { now: () => 0 } };
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(js, "utf8"), ctx);
vm.runInContext(`gSelect = { childNodes: [], selectedIndex: 0 };`, ctx);
ctx.__data = JSON.parse(fs.readFileSync(data, "utf8"));
try {
  vm.runInContext(`gData = __data; gSelect.childNodes = gSelectData.map(() => ({ disabled: false, selected: false })); buildTree(); __out = { tb: gRoot._totalBytes, tbk: gRoot._totalBlocks, kids: gRoot._kids ? gRoot._kids.length : 0 };`, ctx);
  console.log("OK", JSON.stringify(ctx.__out));
} catch (e) { console.log("ERROR", e.message); process.exit(1); }
