//! Pearson's chi-square goodness-of-fit test with its p-value (regularised upper
//! incomplete gamma, Numerical Recipes' `gammq`), for the sampling-losslessness tests.

/// ln Γ(x) (Lanczos, g = 7, n = 9), |error| < 1e-13 for x > 0.
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Q(a, x) = Γ(a, x) / Γ(a).
fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let gln = ln_gamma(a);
    if x < a + 1.0 {
        // Series for P(a, x).
        let (mut ap, mut sum, mut del) = (a, 1.0 / a, 1.0 / a);
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - gln).exp()
    } else {
        // Continued fraction (Lentz) for Q(a, x).
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - gln).exp() * h
    }
}

/// Chi-square test of `observed` counts against `expected` probabilities (summing to
/// 1). Cells with expected count below 5 are pooled into one. Returns (statistic, df,
/// p-value).
pub fn chi_square(observed: &[u64], expected: &[f64]) -> (f64, usize, f64) {
    assert_eq!(observed.len(), expected.len());
    let n: u64 = observed.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in observed.iter().zip(expected) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pool_e > 0.0 {
        if pool_e >= 1e-9 {
            stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
            cells += 1;
        } else {
            assert_eq!(pool_o, 0.0, "a token of probability ~0 was drawn");
        }
    }
    let df = cells.saturating_sub(1).max(1);
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

#[test]
fn chi_square_reference_values() {
    // Q(df/2, x/2) at known points: chi2(df=1) 3.841 -> 0.05, chi2(df=10) 18.307 -> 0.05,
    // chi2(df=100) 124.342 -> 0.05.
    for (df, x) in [(1.0, 3.841_458_8), (10.0, 18.307_038), (100.0, 124.342_14)] {
        let p = gamma_q(df / 2.0, x / 2.0);
        assert!((p - 0.05).abs() < 1e-4, "df {df}: {p}");
    }
}
