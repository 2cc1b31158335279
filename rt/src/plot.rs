//! Plots: round axis ticks, and the loss curve training draws.

/// Round tick positions for an axis from `lo` to `hi`: a step of 1, 2 or 5 times a power
/// of ten giving about `n` ticks, and the decimals that step needs.
pub fn ticks(lo: f64, hi: f64, n: f64) -> (Vec<f64>, usize) {
    if !lo.is_finite() || !hi.is_finite() || hi <= lo {
        return (vec![lo], 2);
    }
    let raw = ((hi - lo) / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&x| x >= raw)
        .unwrap_or(10.0 * mag);
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    let first = (lo / step).ceil() as i64;
    let mut out = Vec::new();
    let mut k = first;
    while (k as f64) * step <= hi + step * 1e-9 && out.len() < 1000 {
        out.push(k as f64 * step);
        k += 1;
    }
    (out, decimals)
}

/// The loss curve as SVG: each step's loss, and the evaluations' train and val losses.
pub fn loss_curve(curve: &[(u64, f64)], evals: &[(u64, f64, f64)]) -> String {
    // The plot area: left margin for the loss ticks, bottom for the step ticks, top for
    // the title and legend.
    let (w, h) = (760.0, 440.0);
    let (left, right, top, bottom) = (64.0, 20.0, 46.0, 52.0);
    let last = curve.last().map_or(1, |c| c.0).max(1) as f64;
    let first = curve.first().map_or(0, |c| c.0) as f64;
    let losses = curve
        .iter()
        .map(|c| c.1)
        .chain(evals.iter().flat_map(|e| [e.1, e.2]));
    let (lo, hi) = losses
        .filter(|x| x.is_finite())
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo < hi { (lo, hi) } else { (0.0, 1.0) };
    let x = |s: f64| left + (s - first) / (last - first).max(1.0) * (w - left - right);
    let y = |v: f64| top + (hi - v) / (hi - lo) * (h - top - bottom);
    let points: Vec<String> = curve
        .iter()
        .filter(|c| c.1.is_finite())
        .map(|c| format!("{:.1},{:.1}", x(c.0 as f64), y(c.1)))
        .collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <text x=\"4\" y=\"15\">training loss (cross-entropy, nats per token) by step</text>\n"
    );
    // Axes with round ticks.
    let (x0, y0, x1, y1) = (left, h - bottom, w - right, top);
    s.push_str(&format!(
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"#333\"/><line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"#333\"/>\n"
    ));
    let (steps, _) = ticks(first, last, 8.0);
    for t in steps {
        let px = x(t);
        s.push_str(&format!(
            "<line x1=\"{px:.1}\" y1=\"{y0}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#333\"/><text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{t:.0}</text>\n",
            y0 + 4.0,
            y0 + 16.0
        ));
    }
    let (marks, decimals) = ticks(lo, hi, 6.0);
    for v in marks {
        let py = y(v);
        s.push_str(&format!(
            "<line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x1}\" y2=\"{py:.1}\" stroke=\"#ddd\"/><line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x0}\" y2=\"{py:.1}\" stroke=\"#333\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{v:.decimals$}</text>\n",
            x0 + 1.0,
            x0 - 4.0,
            x0 - 6.0,
            py + 4.0
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">step</text>\n\
         <text transform=\"translate(14,{:.1}) rotate(-90)\" text-anchor=\"middle\">loss (nats)</text>\n",
        (x0 + x1) / 2.0,
        h - 12.0,
        (y0 + y1) / 2.0
    ));
    s.push_str(&format!(
        "<polyline fill=\"none\" stroke=\"#8ecae6\" points=\"{}\"/>\n",
        points.join(" ")
    ));
    for (t, tr, va) in evals {
        s.push_str(&format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#219ebc\"/><circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#fb8500\"/>\n",
            x(*t as f64),
            y(*tr),
            x(*t as f64),
            y(*va)
        ));
    }
    // The legend.
    s.push_str(
        "<line x1=\"4\" y1=\"30\" x2=\"20\" y2=\"30\" stroke=\"#8ecae6\" stroke-width=\"2\"/><text x=\"24\" y=\"34\">loss of each step's batch</text>\n\
         <circle cx=\"180\" cy=\"30\" r=\"3\" fill=\"#219ebc\"/><text x=\"188\" y=\"34\">evaluation: train</text>\n\
         <circle cx=\"300\" cy=\"30\" r=\"3\" fill=\"#fb8500\"/><text x=\"308\" y=\"34\">evaluation: val</text>\n</svg>\n",
    );
    s
}
