"""Writes finance_qa_zh.jsonl: open-ended Chinese finance Q&A whose answers are sentences.

Each concept is asked in several wordings and answered in several wordings (the same facts said
differently), so exact match cannot judge it and ROUGE/BLEU can. Deterministic (seeded).

    python profiles/data/make_finance_qa_zh.py      # rewrites profiles/data/finance_qa_zh.jsonl
"""

import json
import random
from pathlib import Path

# (concept, what it is, what it is used for)
CONCEPTS = [
    ("市盈率", "股价除以每股收益得到的比值", "常用来判断股票估值是否偏高"),
    ("市净率", "股价除以每股净资产得到的比值", "适合评估银行等重资产公司的估值"),
    ("股息率", "每年分红除以股价得到的比例", "可以衡量持股获得现金回报的高低"),
    ("通货膨胀", "物价水平持续普遍上涨的现象", "会让货币的购买力逐渐下降"),
    ("基准利率", "央行公布的作为定价参考的利率", "会影响贷款和存款的成本"),
    ("债券", "发行人向投资者借款并承诺还本付息的凭证", "通常比股票的波动更小"),
    ("指数基金", "按照某个指数的成分股买入并持有的基金", "费用低而且分散风险"),
    ("复利", "把利息再投入继续产生利息的计算方式", "时间越长增长越明显"),
    ("杠杆", "借入资金放大投资规模的做法", "会同时放大收益和亏损"),
    ("流动性", "资产能够快速变现而不明显损失价值的能力", "现金的流动性最好"),
    ("资产负债率", "总负债除以总资产得到的比例", "反映公司的偿债压力"),
    ("毛利率", "毛利润除以营业收入得到的比例", "体现产品本身的盈利能力"),
    ("自由现金流", "经营现金流减去资本开支后的余额", "说明公司真正能自由支配的现金"),
    ("分散投资", "把资金分配到不同资产上的做法", "可以降低单一资产带来的风险"),
    ("止损", "亏损达到预设幅度时卖出的操作", "用来控制单笔交易的最大损失"),
    ("定投", "每隔固定时间投入固定金额的投资方法", "能够平滑买入成本"),
    ("国债", "由国家财政发行的债券", "信用风险很低"),
    ("可转债", "可以按约定条件转换成股票的债券", "兼有债券的保底和股票的弹性"),
    ("市值", "股价乘以总股本得到的公司总价值", "用来比较公司的规模大小"),
    ("净资产收益率", "净利润除以净资产得到的比例", "衡量公司运用股东资金赚钱的效率"),
    ("波动率", "资产价格变化幅度的统计量", "数值越大说明风险越高"),
    ("夏普比率", "超额收益除以收益波动得到的比值", "用来比较承担每单位风险获得的回报"),
    ("货币基金", "主要投资短期货币市场工具的基金", "风险低而且赎回方便"),
    ("汇率", "一种货币兑换另一种货币的比价", "会影响进出口和海外投资的收益"),
    ("量化宽松", "央行大规模购买资产向市场注入资金的政策", "目的是压低利率刺激经济"),
    ("信用评级", "评级机构对债务人还款能力的评价", "评级越低借款成本通常越高"),
    ("期权", "在约定时间以约定价格买卖资产的权利", "买方可以选择是否行使这个权利"),
    ("期货", "约定在未来某一时间按约定价格交割的合约", "常被企业用来对冲价格风险"),
    ("做空", "先借入资产卖出再低价买回归还的操作", "在价格下跌时获利"),
    ("分红", "公司把部分利润以现金或股票形式分给股东", "体现公司回报股东的意愿"),
    ("资产配置", "按照目标和风险承受能力分配各类资产比例的做法", "决定了组合的大部分长期收益"),
    ("久期", "债券现金流的加权平均回收期限", "久期越长对利率变化越敏感"),
    ("回撤", "资产从高点下跌到低点的幅度", "反映投资过程中可能承受的损失"),
    ("印花税", "对股票交易等行为征收的税", "会增加交易成本"),
    ("首次公开募股", "公司第一次向公众发行股票并上市的过程", "可以帮助公司筹集发展资金"),
    ("商业银行", "吸收存款并发放贷款的金融机构", "是货币信用体系的重要组成部分"),
]

QUESTIONS = [
    "什么是{c}？",
    "请解释一下{c}。",
    "{c}是什么意思？",
    "能简单介绍一下{c}吗？",
    "我想了解{c}，它指的是什么？",
    "{c}怎么理解？",
    "通俗地讲，{c}是什么？",
    "请问{c}指什么？",
]

ANSWERS = [
    "{c}是{what}，{use}。",
    "简单来说，{c}就是{what}，{use}。",
    "{c}指的是{what}，它{use}。",
    "所谓{c}，是指{what}，{use}。",
]


def records(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for concept, what, use in CONCEPTS:
        for question in QUESTIONS:
            answer = rng.choice(ANSWERS).format(c=concept, what=what, use=use)
            rows.append(
                {
                    "conversations": [
                        {"from": "human", "value": question.format(c=concept)},
                        {"from": "gpt", "value": answer},
                    ]
                }
            )
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    target = Path(__file__).with_name("finance_qa_zh.jsonl")
    target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records()), encoding="utf-8")
    print(f"wrote {target} ({len(records())} records)")
